"""The model runner: one scheduler step -> one forward pass -> sampled tokens (chapters 04-05).

The step's tokens from all requests are laid end to end in ONE row, with no padding, and one
`StepMetadata` (cache/paged.py) tells attention where each request's queries and keys are:

    request       A (decode)   B (prefill chunk of 4)   C (decode)
    input_ids     [a7,          b0 b1 b2 b3,             c12]              [1, T_total = 6]
    positions     [7,           0  1  2  3,              12]
    cu_seqlens_q  [0, 1, 5, 6]        seq_lens  [8, 4, 13]

The linear layers (the bulk of the FLOPs) see T_total rows no matter which request they come
from; only attention needs the per-request structure. Logits are computed only for the last
token of each request whose step reaches its end (a request halfway through a chunked prefill
samples nothing), so a 2048-token prefill costs one lm_head row, not 2048.

`execute` returns tokens, not logits: each sequence that reached its end gets one sampled token
(greedy rows in one batched argmax, sampled rows with the request's own generator, so a seeded
request reproduces whatever its batch), or, when it carried k drafts (chapter 07), the 1..k+1
tokens the verifier keeps. Failures belong to sequences: if the batched forward raises, each
request runs alone to find which fail; a failed forward, sampling or verification is reported in
`errors` and the scheduler finishes that sequence alone.

Before the forward the runner performs the scheduler's block copies in a fixed order: swap out
(device -> CPU pool), swap in (CPU pool -> device), copy-on-write. Blocks freed in this step may
already be handed to another request, but nothing writes into them until the forward pass, so
reading them first is safe.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..cache.paged import PagedKVCache, build_step_metadata, resolve_kv_cache_dtype
from ..kvmath import kv_bytes_per_token
from ..model import capture_features, capture_hidden, prepack
from ..sampling import apply_penalties, greedy_ids, sample, token_logprobs
from .cuda_graphs import build_graph_runner
from .spec_decode import tree_depth, verify, verify_tree

# num_kv_blocks=None sizes the pool from memory:
CUDA_KV_FRACTION = 0.5          # of the GPU memory still free after the weights are loaded
CPU_KV_BYTES = 256 * 2**20      # a fixed, modest 256 MiB on the CPU


def kv_blocks_for_memory(model, block_size: int, max_num_seqs: int,
                         kv_cache_dtype: str = "auto") -> int:
    """How many KV blocks fit the memory budget (never more than max_num_seqs full contexts).
    An fp8 cache (kv_cache_dtype) costs one byte per value, so twice bf16's blocks fit."""
    cfg = model.config
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model.dtype)
    per_block = kv_bytes_per_token(cfg, dtype=kv_dtype) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = free * CUDA_KV_FRACTION
    else:
        budget = CPU_KV_BYTES
    useful = max_num_seqs * math.ceil(cfg.max_position_embeddings / block_size)
    return max(1, min(int(budget // per_block), useful))


@dataclass
class ModelRunnerOutput:
    """What one executed step returns, keyed by Request.seq_id."""
    sampled: dict = field(default_factory=dict)      # seq_id -> [new token ids] (1, or 1..k+1)
    num_drafts: dict = field(default_factory=dict)   # seq_id -> drafts it verified (k >= 1)
    errors: dict = field(default_factory=dict)       # seq_id -> why its step failed
    hidden: dict = field(default_factory=dict)       # seq_id -> [C] hidden state at its last token
                                                     # (only when the proposer needs it)
    features: dict = field(default_factory=dict)     # seq_id -> [m, C] final-norm features of the
                                                     # m positions it kept (EAGLE's proposer only)
    logprobs: dict = field(default_factory=dict)     # seq_id -> [{id: (logprob, rank)}] per
                                                     # sampled token (SamplingParams.logprobs)
    prompt_logprobs: dict = field(default_factory=dict)   # seq_id -> (first position, [{...}])
    paths: dict = field(default_factory=dict)        # seq_id -> the tree nodes a tree
                                                     # verification kept, root first (chapter 07)
    tree_depths: dict = field(default_factory=dict)  # seq_id -> that tree's depth


@dataclass
class StepInputs:
    """One forward's inputs: the flat token row, attention's metadata, and where to sample."""
    input_ids: torch.Tensor          # [1, T]
    meta: object                     # StepMetadata
    logits_rows: torch.Tensor        # [S] rows of the flat batch that get logits
    samplers: list                   # [(request, first logits row, num_drafts)]
    prompt_rows: list = field(default_factory=list)   # [(request, first logits row, first
                                     # position it predicts, count)]: prompt logprobs


class ModelRunner:
    def __init__(self, model, block_manager, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, needs_hidden: bool = False,
                 needs_features: bool = False, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = True, max_num_seqs: int = 64):
        self.model = model
        self.bm = block_manager
        self.device = model.device
        self.block_size = block_size
        self.needs_hidden, self.needs_features = needs_hidden, needs_features
        self.cache = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype,
                                  device=model.device, num_cpu_blocks=num_cpu_blocks,
                                  block_manager=block_manager, kv_cache_dtype=kv_cache_dtype)
        prepack(model)          # CPU products on packed weights (ch. 12): now, not mid-request
        # decode steps replayed from CUDA graphs (chapter 12); NoGraphs on CPU / when eager
        self.graphs = build_graph_runner(model, self.cache, max_num_seqs, enforce_eager,
                                         needs_hidden or needs_features)

    # --- one step ------------------------------------------------------------------------------
    def execute(self, sched) -> ModelRunnerOutput:
        """Block copies, ONE forward over the ragged batch, then sampling / verification."""
        out = ModelRunnerOutput()
        self.copy_blocks(sched)
        with capture_hidden(self.model, self.needs_hidden) as cap, \
                capture_features(self.model, self.needs_features) as feats:
            logits, samplers, prompt_rows = self._forward(sched.scheduled, out.errors)  # [S, V]
        hidden = (cap.value[0] if cap.value is not None and cap.value.shape[1] == len(logits)
                  else None)
        self._prompt_logprobs(logits, prompt_rows, out)
        for child, parent in sched.forks:       # siblings sample from their parent's row
            row = next((r for req, r, _ in samplers if req is parent), None)
            if row is None:
                out.errors[child.seq_id] = out.errors.get(parent.seq_id, "its parent failed")
            else:
                samplers.append((child, row, 0))
        raw = self._raw_logprobs(logits, samplers)      # before penalties and masks
        self._process_logits(logits, samplers, out)
        self._sample(logits, samplers, hidden, out)
        self._sampled_logprobs(raw, samplers, out)
        for req, _, _ in samplers:              # a tree keeps one branch: its K/V move to the
            if req.seq_id in out.paths and req.seq_id in out.sampled:   # slots after the context
                self.cache.compact(req.kv.block_ids, req.num_computed_tokens,
                                   out.paths[req.seq_id])
        if feats.value is not None:
            self._features(sched.scheduled, feats.value[0], out)
        return out

    def _features(self, scheduled, x, out: ModelRunnerOutput) -> None:
        """EAGLE (chapter 07): each sampled sequence's features at the positions this step
        computed and keeps (a verification keeps the last token's and the accepted drafts'),
        x [T, C] = the last layer's output over the step's flat row."""
        offset = 0
        for req, n in scheduled:
            k = req.num_computed_tokens + n - req.num_tokens          # drafts verified
            if k >= 0 and req.seq_id in out.sampled:
                kept = n - k + len(out.sampled[req.seq_id]) - 1
                rows = x[offset:offset + kept]                                    # [m, C]
                if req.seq_id in out.paths:     # a tree: the rows before it, then the branch
                    root = offset + n - k - 1
                    path = torch.tensor(out.paths[req.seq_id], device=x.device)
                    rows = torch.cat((x[offset:root], x[root + path]))
                out.features[req.seq_id] = self.model.norm(rows)
            offset += n

    def prepare(self, scheduled) -> StepInputs:
        """Flatten [(request, num_new_tokens)] into the step's tensors (built once per step)."""
        ids, spans, tables, rows, samplers, extra = [], [], [], [], [], []
        trees = {}                               # sequence index -> its tree's parents
        for req, n in scheduled:
            c = req.num_computed_tokens
            self._prompt_rows(req, c, n, len(ids), extra)
            ids.extend(req.token_ids(c, c + n))
            spans.append((c, n))
            tables.append(req.kv.block_ids)
            k = c + n - req.num_tokens           # drafts verified (chapter 07); < 0: mid-prefill
            if k >= 0:                           # the step reaches its last token: sample
                samplers.append((req, len(rows), k))
                rows.extend(range(len(ids) - 1 - k, len(ids)))
                if k and req.spec_tree_parents is not None:   # the budget may cut a tree's
                    trees[len(spans) - 1] = req.spec_tree_parents[:k + 1]   # last nodes
        prompt_rows = []                        # prompt-logprob rows go after the sampled ones
        for req, first_id, pos, count in extra:
            prompt_rows.append((req, len(rows), pos, count))
            rows.extend(range(first_id, first_id + count))
        dev = self.device
        meta = build_step_metadata(spans, tables, self.block_size, dev)
        if trees:
            meta = self._tree_metadata(meta, spans, trees)
        return StepInputs(torch.tensor([ids], dtype=torch.long, device=dev), meta,
                          torch.tensor(rows, dtype=torch.long, device=dev), samplers,
                          prompt_rows)

    @staticmethod
    def _tree_metadata(meta, spans, trees: dict):
        """A tree's n nodes sit in slots c .. c + n - 1 but at positions c + depth (siblings
        share one), and each sees the context and its own ancestors only (spec/tree.py)."""
        from ..spec.tree import depths, tree_mask
        positions, masks, offset = meta.positions.clone(), [None] * len(spans), 0
        for b, (c, n) in enumerate(spans):
            if b in trees:
                positions[offset:offset + n] = torch.tensor([c + d for d in depths(trees[b])])
                masks[b] = tree_mask(trees[b]).to(positions.device)           # [n, n]
            offset += n
        return dataclasses.replace(meta, positions=positions, tree_masks=tuple(masks))

    @staticmethod
    def _prompt_rows(req, c: int, n: int, offset: int, extra: list) -> None:
        """Rows of this chunk whose logits score the NEXT prompt token (prompt_logprobs): chunk
        positions c .. min(c + n, P - 1) - 1, each predicting the token after it. Positions
        already reported (a recompute after preemption) are not asked for again."""
        if req.params.prompt_logprobs is None:
            return
        start = max(c, len(req.prompt_logprobs) - 1)
        end = min(c + n, req.num_prompt_tokens - 1)
        if end > start:
            extra.append((req, offset + start - c, start + 1, end - start))

    def run(self, scheduled):
        """Prepare and run the forward for [(request, num_new_tokens)]. Returns (logits [S, V],
        [(request, first row, num_drafts)] of the requests whose step reaches their last token).
        Writes only these requests' new K/V slots, so running it again for some of them (after a
        failure) is harmless."""
        step = self.prepare(scheduled)
        logits = self.graphs.run(step, scheduled)                               # [B, V] or None
        if logits is not None:
            return logits, step.samplers, step.prompt_rows
        self.cache.set_step(step.meta)
        logits = self.model(step.input_ids, positions=step.meta.positions[None], cache=self.cache,
                            logits_rows=step.logits_rows)                       # [1, S, V]
        return logits[0], step.samplers, step.prompt_rows

    def _forward(self, scheduled, errors: dict):
        """The step's forward. If the batch raises, run each request alone: the ones that fail
        again get an error, the others' logits are used as if nothing happened (their K/V slots
        are simply written a second time)."""
        try:
            return self.run(scheduled)
        except Exception as e:                  # noqa: BLE001 - attributed below
            if len(scheduled) == 1:             # nothing to bisect: it is this request's
                errors[scheduled[0][0].seq_id] = f"forward failed: {type(e).__name__}: {e}"
                return self._no_logits(), [], []
        parts, samplers, prompt_rows, offset = [], [], [], 0
        for req, n in scheduled:
            try:
                logits, own, own_prompt = self.run([(req, n)])
            except Exception as e:              # noqa: BLE001 - this request's error only
                errors[req.seq_id] = f"forward failed: {type(e).__name__}: {e}"
                continue
            parts.append(logits)
            samplers += [(r, row + offset, k) for r, row, k in own]
            prompt_rows += [(r, row + offset, p, c) for r, row, p, c in own_prompt]
            offset += len(logits)
        return ((torch.cat(parts), samplers, prompt_rows) if parts
                else (self._no_logits(), [], []))

    def _no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.model.config.vocab_size, device=self.device)   # [0, V]

    # --- logprobs, penalties, grammars (chapter 08) ---------------------------------------------
    @staticmethod
    def _prompt_logprobs(logits, prompt_rows, out: ModelRunnerOutput) -> None:
        """Raw log-probabilities of prompt tokens: row i of a span scores token pos + i."""
        for req, row, pos, count in prompt_rows:
            lp = torch.log_softmax(logits[row:row + count].float(), dim=-1)   # [count, V]
            toks = req.prompt_token_ids[pos:pos + count]
            k = req.params.prompt_logprobs
            out.prompt_logprobs[req.seq_id] = (pos, [token_logprobs(lp[i], t, k)
                                                     for i, t in enumerate(toks)])

    @staticmethod
    def _raw_logprobs(logits, samplers) -> dict:
        """seq_id -> raw log_softmax [1 + k, V] of the rows of requests that report logprobs,
        taken before penalties and grammar masks change the logits."""
        return {req.seq_id: torch.log_softmax(logits[row:row + 1 + k].float(), dim=-1)
                for req, row, k in samplers if req.params.logprobs is not None}

    @staticmethod
    def _process_logits(logits, samplers, out: ModelRunnerOutput) -> None:
        """Penalties (each request's own tokens), then every grammar's token mask, applied to the
        batch's logits rows in one masked_fill before anything samples. A request whose grammar
        fails gets an error; the others sample normally."""
        rows, masks, done = [], [], set()
        for req, row, k in samplers:
            if row in done:                     # an n > 1 sibling shares its parent's row
                continue
            done.add(row)
            try:
                apply_penalties(logits[row:row + 1 + k], req.params, req.prompt_token_ids,
                                req.output_token_ids)
                allowed = req.grammar.allowed(logits.shape[-1])            # [V] bool or None
            except Exception as e:              # noqa: BLE001 - this request's error only
                out.errors[req.seq_id] = f"logits processing failed: {type(e).__name__}: {e}"
                continue
            if allowed is not None:
                rows.append(row)
                masks.append(allowed)
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            mask = torch.stack(masks).to(logits.device)                     # [G, V]
            logits[idx] = logits[idx].masked_fill(~mask, float("-inf"))

    @staticmethod
    def _sampled_logprobs(raw: dict, samplers, out: ModelRunnerOutput) -> None:
        """After sampling: the grammar consumes the sampled token (a refusal fails that request)
        and logprobs are read for each sampled token from its own row."""
        for req, _, _ in samplers:
            toks = out.sampled.get(req.seq_id)
            if toks is None:
                continue
            try:
                for t in toks:
                    req.grammar.accept(t)
            except Exception as e:              # noqa: BLE001 - this request's error only
                del out.sampled[req.seq_id]
                out.errors[req.seq_id] = f"structured output failed: {e}"
                continue
            if req.seq_id in raw:
                lp, k = raw[req.seq_id], req.params.logprobs
                at = out.paths.get(req.seq_id, range(len(toks)))   # each token's own row
                out.logprobs[req.seq_id] = [token_logprobs(lp[at[i]], t, k)
                                            for i, t in enumerate(toks)]

    def _sample(self, logits, samplers, hidden, out: ModelRunnerOutput) -> None:
        """One token per plain row (greedy ones in one batched argmax), verification for rows
        that carry drafts. A failure is that sequence's alone."""
        greedy = [(req, row) for req, row, k in samplers
                  if k == 0 and req.params.greedy and req.seq_id not in out.errors]
        if greedy:
            try:
                rows = [row for _, row in greedy]
                # index_select copies whole rows; logits[idx] took 3 ms for 16 x 49152 on a CPU
                picked = logits if rows == list(range(len(logits))) else logits.index_select(
                    0, torch.tensor(rows, device=logits.device))
                for (req, _), t in zip(greedy, greedy_ids(picked).tolist()):
                    out.sampled[req.seq_id] = [t]
            except Exception:                   # noqa: BLE001 - found row by row below
                pass
        for req, row, k in samplers:
            if req.seq_id not in out.sampled and req.seq_id not in out.errors:
                self._sample_one(logits, req, row, k, out)
            if hidden is not None and req.seq_id in out.sampled:
                last = len(out.sampled[req.seq_id]) - 1
                last = out.paths[req.seq_id][last] if req.seq_id in out.paths else last
                out.hidden[req.seq_id] = hidden[row + last]                           # [C]

    @staticmethod
    def _sample_one(logits, req, row: int, k: int, out: ModelRunnerOutput) -> None:
        try:
            if k and req.spec_tree_parents is not None:       # a tree (chapter 07)
                nodes = req.token_ids(req.num_tokens - 1, req.num_tokens) + req.spec_token_ids[:k]
                parents = req.spec_tree_parents[:k + 1]
                out.sampled[req.seq_id], out.paths[req.seq_id] = verify_tree(
                    logits[row:row + 1 + k], nodes, parents, req.params, req.generator)
                out.num_drafts[req.seq_id] = k                       # every node (rollback)
                out.tree_depths[req.seq_id] = tree_depth(parents)
            elif k:
                probs = req.spec_draft_probs
                out.sampled[req.seq_id] = verify(logits[row:row + 1 + k], req.spec_token_ids[:k],
                                                 None if probs is None else probs[:k],
                                                 req.params, req.generator)
                out.num_drafts[req.seq_id] = k
            else:
                out.sampled[req.seq_id] = [int(sample(logits[row:row + 1], req.params,
                                                      req.generator))]
        except Exception as e:                  # noqa: BLE001 - reported as the request's error
            what = "verification" if k else "sampling"
            out.errors[req.seq_id] = f"{what} failed: {type(e).__name__}: {e}"

    def copy_blocks(self, sched) -> None:
        """The scheduler's block copies, in order: swap out, swap in, copy-on-write, then the
        blocks a KV tier loads."""
        self.cache.swap_out_blocks(sched.blocks_to_swap_out)    # device -> CPU pool
        self.cache.swap_in_blocks(sched.blocks_to_swap_in)      # CPU pool -> device
        self.cache.copy_blocks(sched.blocks_to_copy)            # copy-on-write
        for block_ids, loads in sched.kv_loads:                 # from a KV tier (chapter 11)
            self.cache.swap_in(block_ids, torch.stack([k for k, _ in loads], 1),
                               torch.stack([v for _, v in loads], 1))
