"""The model runner: one scheduler step -> one forward pass over a ragged batch (chapters 04-05).

The step's tokens from all requests are laid end to end in ONE row, with no padding:

    request       A (decode)   B (prefill chunk of 4)   C (decode)
    input_ids     [a7,          b0 b1 b2 b3,             c12]              [T_total = 6]
    positions     [7,           0  1  2  3,              12]
    slot_mapping  where each token's K/V goes in the paged pool (block * block_size + offset)
    cu_seqlens_q  [0, 1, 5, 6]        row ranges of each request's queries
    seq_lens      [8, 4, 13]          context each request attends over, this step included
    block_tables  [3, max_blocks]     each request's blocks, padded with 0

The linear layers (the bulk of the FLOPs) see T_total rows no matter which request they come
from; only attention needs the per-request structure, and the paged cache gets it through
`set_step`. Logits are computed only for the last token of each request whose step reaches its
end (a request halfway through a chunked prefill samples nothing), so a 2048-token prefill costs
one lm_head row, not 2048.

Before the forward the runner performs the scheduler's block copies in a fixed order: swap out
(device -> CPU pool), swap in (CPU pool -> device), copy-on-write. Blocks freed in this step may
already be handed to another request, but nothing writes into them until the forward pass, so
reading them first is safe.
"""
from __future__ import annotations

import math

import torch

from ..cache.paged import PagedKVCache
from ..kvmath import kv_bytes_per_token
from ..sampling import sample

# num_kv_blocks=None sizes the pool from memory:
CUDA_KV_FRACTION = 0.5          # of the GPU memory still free after the weights are loaded
CPU_KV_BYTES = 256 * 2**20      # a fixed, modest 256 MiB on the CPU


def kv_blocks_for_memory(model, block_size: int, max_num_seqs: int) -> int:
    """How many KV blocks fit the memory budget (never more than max_num_seqs full contexts)."""
    cfg = model.config
    per_block = kv_bytes_per_token(cfg, dtype=model.dtype) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = free * CUDA_KV_FRACTION
    else:
        budget = CPU_KV_BYTES
    useful = max_num_seqs * math.ceil(cfg.max_position_embeddings / block_size)
    return max(1, min(int(budget // per_block), useful))


class ModelRunner:
    def __init__(self, model, block_manager, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0):
        self.model = model
        self.bm = block_manager
        self.device = model.device
        cfg = model.config
        self.cache = PagedKVCache(cfg, num_blocks, block_size, dtype=model.dtype,
                                  device=model.device, num_cpu_blocks=num_cpu_blocks,
                                  block_manager=block_manager)

    # --- one step ------------------------------------------------------------------------------
    def prepare(self, scheduled):
        """Flatten [(request, num_new_tokens)] into the step's tensors (built once per step)."""
        ids, positions, slots, tables, seq_lens, cu = [], [], [], [], [], [0]
        sample_rows, sampling_reqs = [], []
        for req, n in scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids.extend(req.token_ids(start, end))
            positions.extend(range(start, end))
            slots.extend(self.bm.slot_mapping(req.seq_id, start, end))
            tables.append(self.bm.block_table(req.seq_id))
            seq_lens.append(end)
            cu.append(cu[-1] + n)
            if end == req.num_tokens:                        # the step reaches its last token
                sample_rows.append(cu[-1] - 1)
                sampling_reqs.append(req)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        step = dict(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),          # [T]
            positions=torch.tensor(positions, dtype=torch.long, device=dev),    # [T]
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),     # [T]
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),   # [B, max_blocks]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),     # [B]
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),       # [B + 1]
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),  # [S]
            is_decode_only=all(n == 1 for _, n in scheduled))
        return step, sampling_reqs

    def forward(self, step) -> torch.Tensor:
        """The model on the ragged row [1, T], with logits only at sample_rows: [S, V]."""
        self.cache.set_step(step["slot_mapping"], step["block_tables"], step["seq_lens"],
                            step["cu_seqlens_q"], step["is_decode_only"])
        logits = self.model(step["input_ids"][None], positions=step["positions"][None],
                            cache=self.cache, logits_rows=step["sample_rows"])   # [1, S, V]
        return logits[0]

    def copy_blocks(self, sched) -> None:
        """The scheduler's block copies, in order: swap out, swap in, copy-on-write."""
        self.cache.swap_out_blocks(sched.blocks_to_swap_out)    # device -> CPU pool
        self.cache.swap_in_blocks(sched.blocks_to_swap_in)      # CPU pool -> device
        self.cache.copy_blocks(sched.blocks_to_copy)            # copy-on-write

    def run(self, scheduled):
        """Prepare and run the forward for [(request, num_new_tokens)]. Returns (logits [S, V],
        the S requests whose step reaches their last token). Writes only these requests' new
        K/V slots, so running it again for some of them (after a failure) is harmless."""
        step, sampling_reqs = self.prepare(scheduled)
        return self.forward(step), sampling_reqs

    def execute(self, sched):
        """Do the block copies, run the forward. Returns (logits [S, V], the S requests)."""
        self.copy_blocks(sched)
        return self.run(sched.scheduled)


def sample_tokens(logits: torch.Tensor, rows) -> list:
    """One token per (request, row of logits): greedy rows in one batched argmax, sampled rows
    each with the request's own generator (so a seeded request reproduces whatever its batch).

    Entry i is an int, or the exception that sampling row i raised: one request's failure
    (NaN logits, a bad generator...) is that request's alone."""
    tokens: list = [0] * len(rows)
    greedy = [i for i, (req, _) in enumerate(rows) if req.params.greedy]
    if greedy:
        try:
            idx = torch.tensor([rows[i][1] for i in greedy], device=logits.device)
            for i, t in zip(greedy, logits[idx].argmax(dim=-1).tolist()):
                tokens[i] = t
        except Exception:                       # find the culprit row by row
            for i in greedy:
                tokens[i] = _sample_one(logits, *rows[i])
    for i, (req, row) in enumerate(rows):
        if not req.params.greedy:
            tokens[i] = _sample_one(logits, req, row)
    return tokens


def _sample_one(logits: torch.Tensor, req, row: int):
    try:
        return int(sample(logits[row:row + 1], req.params, req.generator))
    except Exception as e:                      # noqa: BLE001 - reported as the request's error
        return e
