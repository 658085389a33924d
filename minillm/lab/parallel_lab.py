"""Lab equipment for chapter 10: tensor-parallel ranks as threads (one process, one gloo
group, a second to start instead of a spawned process per rank), the pipeline timeline drawn,
and the GPU communication estimate as a table."""
from __future__ import annotations


import torch

from ..parallel import Communicator, add_all_reduce_hooks, shard_config, shard_state_dict
from ..parallel.comm import LINKS, all_reduce_seconds_estimate, run_on_threads
from ..parallel.worker import build_shard


def threaded_tp_forward(model, tp: int, input_ids, timeout_s: float = 120.0):
    """Every rank's sharded forward of `input_ids` [1, T] (no KV cache), one thread per rank.
    Returns ([logits [1, T, V] per rank], [CommStats per rank])."""
    cfg, full = model.config, model.state_dict()
    store = torch.distributed.HashStore()
    logits, stats = [None] * tp, [None] * tp

    def rank_main(rank):
        comm = Communicator(rank, tp, 0, timeout_s, store=store)
        shard = build_shard(shard_config(cfg, tp), shard_state_dict(full, cfg, rank, tp),
                            model.dtype)
        add_all_reduce_hooks(shard, comm)
        with torch.inference_mode():
            logits[rank] = shard(input_ids)
        stats[rank] = comm.stats
    run_on_threads(rank_main, tp, timeout_s, "a rank")
    return logits, stats


def comm_estimate_rows(cfg, tp: int, batches, dtype_bytes: int = 2, bandwidth_bytes=3.35e12):
    """Per decode step of `cfg` at tensor-parallel degree tp: the all-reduce time on each link
    (ESTIMATE, alpha-beta ring) beside the memory-bound time to read one rank's weights."""
    from ..kvmath import weight_bytes
    read_s = weight_bytes(cfg, "bfloat16") / tp / bandwidth_bytes
    rows = []
    for batch in batches:
        payload = batch * cfg.hidden_size * dtype_bytes             # one all-reduce
        row = {"batch": batch, "weights_read_ms": round(read_s * 1e3, 3)}
        for link in LINKS:
            t = all_reduce_seconds_estimate(payload, tp, link) * 2 * cfg.num_layers
            row[f"{link}_ms"] = round(t * 1e3, 3)
        rows.append(row)
    return rows


def draw_pipeline(spans, pp: int, ax=None, title: str = ""):
    """A Gantt chart of pipeline spans (stage rows, one box per micro-batch)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 * pp + 0.8))
    t0 = min(s.start for s in spans)
    for s in spans:
        ax.barh(s.stage, s.end - s.start, left=s.start - t0, color=f"C{s.micro_batch % 10}",
                edgecolor="black")
        ax.text((s.start + s.end) / 2 - t0, s.stage, str(s.micro_batch), ha="center",
                va="center", fontsize=8)
    ax.set_yticks(range(pp), [f"stage {i}" for i in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title)
    return ax
