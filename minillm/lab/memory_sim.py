"""Memory simulations of chapters 02-03: a request workload run through KV memory, no model.

    trace = simulate_arena(workload.requests, ContiguousArena(8 * 2048))      # ch. 02: slabs
    trace = simulate_blocks(workload.requests, num_blocks=1024, block_size=16)  # ch. 03: blocks
    trace.summary()               # concurrency, wasted fraction, fragmentation, refusals
    plot_memory_map(trace)        # token address over time, a colour per request

Both simulators share one step loop (FCFS admission; prefill writes the prompt, decode one token
a step; a request finishes after prompt_len + output_len tokens) and record a `MemoryTrace`, so
the two memory maps compare line for line. Lab equipment (`minillm.lab`): the engine never
imports it. It drives real allocators: chapter 02's `minillm.lab.arena.ContiguousArena` and the
engine's own `minillm.cache.blocks.BlockManager`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.blocks import BlockManager
from .arena import ContiguousArena


@dataclass
class MemoryTrace:
    """What a memory simulation saw (`simulate_arena` in ch. 02, `simulate_blocks` in ch. 03).

    steps: one dict per busy step; maps: (step, owner, written) snapshots of the token
    addresses sampled every `map_stride` tokens; requests: req_id -> admit/finish step, tokens
    reserved and written at the end of its life."""
    capacity: int
    map_stride: int
    steps: list = field(default_factory=list)
    maps: list = field(default_factory=list)
    requests: dict = field(default_factory=dict)
    num_refused: int = 0
    num_refused_fragmented: int = 0
    num_preempted: int = 0

    def summary(self) -> dict:
        running = [s["running"] for s in self.steps]
        done = [r for r in self.requests.values() if "finish_step" in r]
        written = sum(r["total_len"] for r in done)
        reserved = sum(r["reserved"] for r in done)
        busy = [s for s in self.steps if s["reserved_tokens"]]
        return {
            "steps": len(self.steps), "finished": len(done),
            "peak_concurrency": max(running, default=0),
            "mean_concurrency": sum(running) / len(running) if running else 0.0,
            # per request, at the end of its life: reserved but never written
            "wasted_fraction": 1 - written / reserved if reserved else 0.0,
            # averaged over steps: reserved but not written yet, over reserved
            "mean_internal_fragmentation": (sum(s["internal_fragmentation"] for s in busy)
                                            / len(busy) if busy else 0.0),
            "mean_used_fraction_of_capacity": (sum(s["used_tokens"] for s in self.steps)
                                               / (self.capacity * len(self.steps))
                                               if self.steps else 0.0),
            "steps_blocked_by_fragmentation": sum(s["blocked"] == "fragmented" for s in self.steps),
            "requests_blocked_by_fragmentation": sum(r.get("blocked_fragmented", False)
                                                     for r in self.requests.values()),
            "num_refused": self.num_refused, "num_refused_fragmented": self.num_refused_fragmented,
            "num_preempted": self.num_preempted,
        }


def simulate_arena(requests, arena: ContiguousArena, step_time: float = 0.05,
                   max_steps: int = 1_000_000, map_every: int = 1,
                   map_bins: int = 256) -> MemoryTrace:
    """Run a workload trace (e.g. `minillm.lab.workloads.make_workload(...).requests`) through
    the arena.

    Each step, in order:
      1. admit arrived requests first-come-first-served while a slab of `max_len_reserved`
         fits; the first that does not fit blocks the queue (no skipping ahead);
      2. a newly admitted request writes its whole prompt (prefill); every request admitted
         earlier writes one token (decode);
      3. record stats (and every `map_every` steps a memory-map snapshot);
      4. a request that has written prompt_len + output_len tokens finishes and frees its slab.
    A request arriving at time t can be admitted at the first step with step * step_time >= t.
    """
    requests = sorted(requests, key=lambda r: (r.arrival_time, r.id))
    for r in requests:
        if r.max_len_reserved > arena.capacity:
            raise ValueError(f"request {r.id} reserves {r.max_len_reserved} tokens but the arena "
                             f"holds {arena.capacity}; make the arena larger or the reservation "
                             f"smaller")
        if r.total_len > r.max_len_reserved:
            raise ValueError(f"request {r.id} needs {r.total_len} tokens but reserves only "
                             f"{r.max_len_reserved}")
    stride = max(1, -(-arena.capacity // map_bins))
    trace = MemoryTrace(capacity=arena.capacity, map_stride=stride)
    refused0, frag0 = arena.num_refused, arena.num_refused_fragmented
    waiting, running = list(requests), {}                       # running: req_id -> (request, slab)
    head, step = 0, 0
    while head < len(waiting) or running:
        if step >= max_steps:
            raise ValueError(f"simulation did not finish in {max_steps} steps; raise max_steps")
        now = step * step_time
        if not running and waiting[head].arrival_time > now:     # idle: jump to the next arrival
            step = max(step + 1, int(-(-waiting[head].arrival_time // step_time)))
            continue
        blocked, admitted = "", []
        while head < len(waiting) and waiting[head].arrival_time <= now:
            r = waiting[head]
            slab = arena.allocate(r.id, r.max_len_reserved)
            if slab is None:
                fragmented = arena.free_tokens >= r.max_len_reserved
                blocked = "fragmented" if fragmented else "no_space"
                info = trace.requests.setdefault(r.id, {})
                info["blocked_fragmented"] = info.get("blocked_fragmented", False) or fragmented
                break
            head += 1
            admitted.append(r.id)
            running[r.id] = (r, slab)
            trace.requests.setdefault(r.id, {}).update(
                admit_step=step, start=slab.start, reserved=r.max_len_reserved,
                total_len=r.total_len)
        for rid, (r, slab) in running.items():
            slab.write(r.prompt_len if rid in admitted else 1, value=float(rid % 997 + 1))
        stats = arena.stats()
        stats.update(step=step, time=now, running=len(running), waiting=len(waiting) - head,
                     admitted=len(admitted), blocked=blocked)
        trace.steps.append(stats)
        if step % map_every == 0:
            owner, written = arena.owner_map()
            trace.maps.append((step, owner[::stride], written[::stride]))
        for rid in [rid for rid, (r, slab) in running.items() if slab.seq_len >= r.total_len]:
            arena.free(rid)
            del running[rid]
            trace.requests[rid]["finish_step"] = step
        step += 1
    trace.num_refused = arena.num_refused - refused0
    trace.num_refused_fragmented = arena.num_refused_fragmented - frag0
    return trace


def simulate_blocks(requests, num_blocks: int, block_size: int, step_time: float = 0.05,
                    max_steps: int = 1_000_000, map_every: int = 1,
                    map_bins: int = 256) -> MemoryTrace:
    """Chapter 02's workload through paged blocks instead of slabs (memory only, no model).

    Same step loop as `simulate_arena` (FCFS admission; prefill writes the prompt,
    decode one token a step; finish after prompt_len + output_len tokens), but a request takes
    blocks as it grows instead of a max-length slab. Admission needs only the prompt's blocks.
    When a decode step finds no free block, the most recently admitted request is preempted
    (recompute: its blocks are freed and it rejoins the front of the queue, keeping the tokens
    it generated, which it re-prefills on readmission).
    """
    requests = sorted(requests, key=lambda r: (r.arrival_time, r.id))
    capacity = num_blocks * block_size
    for r in requests:
        if -(-r.total_len // block_size) > num_blocks:
            raise ValueError(f"request {r.id} needs {r.total_len} tokens but the pool holds "
                             f"{capacity}; use more blocks")
    mgr = BlockManager(num_blocks, block_size)
    stride = max(1, -(-capacity // map_bins))
    trace = MemoryTrace(capacity=capacity, map_stride=stride)
    waiting = deque(requests)
    running: dict = {}                                        # req_id -> request, admission order
    generated: dict = {}                                      # req_id -> output tokens written
    step = 0
    while waiting or running:
        if step >= max_steps:
            raise ValueError(f"simulation did not finish in {max_steps} steps; raise max_steps")
        now = step * step_time
        if not running and waiting[0].arrival_time > now:       # idle: jump to the next arrival
            step = max(step + 1, int(-(-waiting[0].arrival_time // step_time)))
            continue
        blocked, admitted = "", []
        while waiting and waiting[0].arrival_time <= now:
            r = waiting[0]
            prefill = r.prompt_len + generated.get(r.id, 0)
            if not mgr.can_allocate(r.id, prefill):
                blocked = "no_space"
                trace.num_refused += 1
                break
            waiting.popleft()
            mgr.allocate(r.id, prefill)
            running[r.id] = r
            admitted.append(r.id)
            trace.requests.setdefault(r.id, {}).setdefault("admit_step", step)
        for rid in list(running):                             # oldest first
            if rid in admitted or rid not in running:
                continue
            while rid in running and not mgr.can_allocate(rid, mgr.num_tokens(rid) + 1):
                victim = next(reversed(running))              # most recently admitted
                generated[victim] = mgr.num_tokens(victim) - running[victim].prompt_len
                mgr.free(victim)
                waiting.appendleft(running.pop(victim))
                trace.num_preempted += 1
            if rid in running:
                mgr.allocate(rid, mgr.num_tokens(rid) + 1)
        used = sum(mgr.lengths.values())
        held = num_blocks - mgr.num_free_blocks
        trace.steps.append({
            "step": step, "time": now, "running": len(running), "waiting": len(waiting),
            "admitted": len(admitted), "blocked": blocked, "num_slabs": len(running),
            "reserved_tokens": held * block_size, "used_tokens": used,
            "free_tokens": mgr.num_free_blocks * block_size,
            "largest_free_extent": mgr.num_free_blocks * block_size,   # any free block serves
            "internal_fragmentation": ((held * block_size - used) / (held * block_size)
                                       if held else 0.0),
            "external_fragmentation": 0.0})
        if step % map_every == 0:
            trace.maps.append((step, *_owner_map(mgr, capacity, stride)))
        for rid in [rid for rid, r in running.items() if mgr.num_tokens(rid) >= r.total_len]:
            r = running.pop(rid)
            trace.requests[rid].update(finish_step=step, total_len=r.total_len,
                                       reserved=len(mgr.tables[rid]) * block_size)
            mgr.free(rid)
        step += 1
    return trace


def _owner_map(mgr: BlockManager, capacity: int, stride: int):
    import numpy as np
    owner = np.full(capacity, -1, dtype=np.int64)
    written = np.zeros(capacity, dtype=bool)
    bs = mgr.block_size
    for seq_id, table in mgr.tables.items():
        n = mgr.lengths[seq_id]
        code = seq_id if isinstance(seq_id, int) and seq_id >= 0 else abs(hash(seq_id)) % 2**31
        for i, block_id in enumerate(table):
            owner[block_id * bs:(block_id + 1) * bs] = code
            written[block_id * bs:block_id * bs + min(bs, n - i * bs)] = True
    return owner[::stride], written[::stride]


def plot_memory_map(trace: MemoryTrace, ax=None, title: str = "KV memory map"):
    """Memory map over time: step on x, token address on y, a colour per request.

    Written tokens are drawn in the request's colour, reserved-but-unwritten tokens in a pale
    tint of it (internal fragmentation), free tokens white. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    if not trace.maps:
        raise ValueError("the trace has no memory-map snapshots; simulate with map_every >= 1")
    owner = np.stack([m[1] for m in trace.maps], axis=1)        # [bins, snapshots]
    written = np.stack([m[2] for m in trace.maps], axis=1)
    palette = plt.get_cmap("tab20").colors
    rgb = np.array([palette[i % len(palette)] for i in range(len(palette))])[owner % len(palette)]
    pale = 1 - 0.3 * (1 - rgb)                                  # blend 70% towards white
    img = np.where(written[..., None], rgb, pale)
    img[owner < 0] = 1.0                                        # free: white
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5), layout="constrained")
    steps = [m[0] for m in trace.maps]
    ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest",
              extent=(steps[0], steps[-1] + 1, 0, owner.shape[0] * trace.map_stride))
    ax.set_xlabel("step")
    ax.set_ylabel("token address in the arena")
    ax.set_title(title)
    return ax


__all__ = ["MemoryTrace", "simulate_arena", "simulate_blocks", "plot_memory_map"]
