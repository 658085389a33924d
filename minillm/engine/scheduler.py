"""The scheduler: which requests compute how many tokens in the next step (chapters 04-05).

Every step it fills a token budget (`max_num_batched_tokens`) from three queues, oldest request
first (FCFS by arrival):

1. running requests, decodes before prefill chunks: a decode costs one token, and serving it
   first keeps inter-token latency steady while long prompts are prefilled around it;
2. swapped and waiting requests are admitted in arrival order while the budget, `max_num_seqs`
   and the KV pool allow, and only if nobody was preempted in this step (memory is short);
   admission stops at the first request that does not fit, so nobody overtakes an older one and
   nobody starves.

With chunked prefill a prompt larger than what is left of the budget takes what is left, and
the rest follows in later steps; any number of prompts can be chunked in the same step. Without
it a prompt is scheduled whole or waits (a request recomputing more tokens than the whole
budget is the one exception: it is chunked, or it could never run again).

When a request needs a KV block and the pool is empty, the scheduler preempts the running
request that arrived LAST (the most recently admitted under FCFS), so the oldest keep their
progress, until the block fits; if the request needing it is itself the newest, it preempts
itself. Preemption by
- "recompute": free the victim's blocks, reset its num_computed_tokens to 0 and put it back at
  the front of the waiting queue (it is older than every request that has not run yet). When
  it is admitted again its prompt and outputs are prefilled as one longer prompt.
- "swap": copy its blocks to a CPU pool, free the GPU blocks, and copy them back into fresh
  blocks before it runs again. Falls back to recompute when the CPU pool is full.

Scheduling "continuous" (iteration-level, Orca) admits new requests at every step. "static"
forms a batch of up to max_num_seqs requests and admits nobody else until the whole batch has
finished: the head-of-line blocking chapter 04 measures.

With prefix caching (chapter 06) the block manager is a `PrefixCachingBlockManager`: admitting
a request that holds no blocks first looks up the longest cached prefix of its tokens, starts
its num_computed_tokens after it, and counts the hit blocks against the pool (a hit on a free
cached block takes it out of the free queue). The engine registers newly computed full blocks
after each forward; a request whose next block is being computed by a running request right now
waits for it (like a request that does not fit) rather than compute the same prefix twice.

The scheduler only plans: it returns the (request, num_new_tokens) pairs plus the block copies
the model runner must do before the forward pass, in this order: swap out, swap in, copy.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)           # [(Request, num_new_tokens)]
    copies: dict = field(default_factory=dict)               # seq_id -> [(src, dst)] copy-on-write
    blocks_to_swap_out: list = field(default_factory=list)   # [(gpu_block, cpu_block)]
    blocks_to_swap_in: list = field(default_factory=list)    # [(cpu_block, gpu_block)]
    preempted: list = field(default_factory=list)            # [Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def blocks_to_copy(self) -> list:
        return [pair for pairs in self.copies.values() for pair in pairs]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 scheduling: str = "continuous", preemption: str = "recompute",
                 cpu_pool=None, clock=None, prefix_cache_stats=None):
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({max_num_seqs}) so every running request can decode "
                             "in each step; raise it or lower max_num_seqs")
        if preemption == "swap" and cpu_pool is None:
            raise ValueError("preemption='swap' needs a CPU block pool (cpu_pool)")
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.scheduling = scheduling
        self.preemption = preemption
        self.cpu_pool = cpu_pool
        self.clock = clock
        # prefix caching is on when the block manager can look up cached blocks (chapter 06)
        self.enable_prefix_caching = hasattr(block_manager, "find_cached_blocks")
        self.prefix_cache_stats = prefix_cache_stats
        self.waiting: list = []      # sorted by arrival: preempted (older) ones first
        self.running: list = []      # sorted by arrival
        self.swapped: list = []      # sorted by arrival
        self.static_batch: set = set()   # request ids of the current static batch
        self.num_preemptions = 0
        self.num_swap_outs = 0          # preemptions that went to the CPU pool

    # --- queues ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def add_running(self, req: Request) -> None:
        """A sibling forked from a running request joins the running batch directly."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_slots(self) -> int:
        return sum(r.slots for r in self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if self.bm.has(req.seq_id):
            self.bm.free(req.seq_id)
        self._free_cpu(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def requeue_all(self) -> None:
        """Send every running and swapped request back to the waiting queue to be recomputed
        from scratch (blocks freed, num_computed_tokens 0, outputs kept). The engine calls this
        when a step fails half-way: whatever the step had copied or written, recomputing is
        correct, and no block stays held by a request that is not running."""
        for req in self.running + self.swapped:
            if self.bm.has(req.seq_id):
                self.bm.free(req.seq_id)
            self._free_cpu(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
        self.running, self.swapped = [], []

    def _free_cpu(self, req: Request) -> None:
        for b in req.swapped_blocks:
            self.cpu_pool.decref(b)
        req.swapped_blocks = []

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. running requests: decodes first, then prefill chunks, oldest first within each.
        order = ([r for r in self.running if not r.is_prefill] +
                 [r for r in self.running if r.is_prefill])
        for req in order:
            if req.status != RequestStatus.RUNNING:       # preempted earlier in this step
                continue
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget == 0:
                break
            n = self._chunk(req, budget)
            if n == 0:
                continue
            self._reserve(req, n, out)

        # 2. admissions, only when nobody was preempted in this step.
        if not out.preempted:
            self._admit(out)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of req's uncomputed tokens to schedule with `budget` tokens left (0: wait)."""
        n = req.num_uncomputed_tokens
        if n <= budget:
            return n
        if self.enable_chunked_prefill or n > self.max_num_batched_tokens:
            return budget
        return 0

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for n more tokens of a running request, preempting the newest running
        requests while the pool is short. False when req had to preempt itself."""
        need = req.num_computed_tokens + n
        while not self.bm.can_allocate(req.seq_id, need):
            victim = self.running[-1]                     # arrived last
            self._preempt(victim, out)
            if victim is req:
                return False
        out.copies[req.seq_id] = self.bm.allocate(req.seq_id, need)
        out.scheduled.append((req, n))
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.num_preemptions += 1
        victim.metrics.num_preemptions += 1
        out.preempted.append(victim)
        for i, (r, _) in enumerate(out.scheduled):       # unschedule it if already planned
            if r is victim:
                del out.scheduled[i]
                break
        pending = dict((dst, src) for src, dst in out.copies.pop(victim.seq_id, []))
        computed = victim.num_computed_tokens
        num_blocks = -(-computed // self.block_size)      # blocks holding the computed tokens
        if (self.preemption == "swap" and computed > 0
                and self.cpu_pool.num_free_blocks >= num_blocks):
            # a copy-on-write planned for it this step has not run yet: read the source block
            gpu_blocks = [pending.get(b, b) for b in self.bm.block_table(victim.seq_id)]
            gpu_blocks = gpu_blocks[:num_blocks]
            cpu_blocks = [self.cpu_pool.allocate() for _ in range(num_blocks)]
            out.blocks_to_swap_out.extend(zip(gpu_blocks, cpu_blocks))
            self.bm.free(victim.seq_id)
            victim.swapped_blocks = cpu_blocks
            victim.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
            bisect.insort(self.swapped, victim, key=lambda r: r.sort_key)
        else:
            self.bm.free(victim.seq_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            bisect.insort(self.waiting, victim, key=lambda r: r.sort_key)

    def _next_candidate(self) -> Optional[Request]:
        heads = [q[0] for q in (self.swapped, self.waiting) if q]
        return min(heads, key=lambda r: r.sort_key) if heads else None

    # --- prefix caching (chapter 06) ----------------------------------------------------------
    def _lookup(self, req: Request) -> list:
        """For a waiting request: the block ids of its longest cached prefix ([] if none or if
        prefix caching is off); its num_computed_tokens starts after them."""
        if not self.enable_prefix_caching or req.status == RequestStatus.SWAPPED:
            return []
        hits = self.bm.find_cached_blocks(req.token_ids(0, req.num_tokens), req.cache_salt)
        req.num_computed_tokens = len(hits) * self.block_size
        return hits

    def _prefix_in_flight(self, req: Request, hits: list) -> bool:
        """The block after req's hit is being computed right now by a running request: wait
        for it (a step or two) instead of computing the same prefix twice in parallel."""
        if not self.enable_prefix_caching or req.status == RequestStatus.SWAPPED:
            return False
        return self.bm.is_computing(req.token_ids(0, req.num_tokens), hits, req.cache_salt)

    def _can_allocate(self, req: Request, num_tokens: int, hits: list) -> bool:
        if hits:        # the hit blocks that sit in the free queue count too
            return self.bm.can_allocate(req.seq_id, num_tokens, hits)
        return self.bm.can_allocate(req.seq_id, num_tokens)

    def _allocate(self, req: Request, num_tokens: int, hits: list) -> list:
        if hits:        # the table starts on the shared blocks, which are never written
            return self.bm.allocate(req.seq_id, num_tokens, hits)
        return self.bm.allocate(req.seq_id, num_tokens)

    def _record_hit(self, req: Request) -> None:
        """Count the prompt's lookup once, at the request's first admission (vLLM's stats)."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
            if self.prefix_cache_stats is not None and self.enable_prefix_caching:
                self.prefix_cache_stats.record(req.num_prompt_tokens, req.num_cached_tokens)

    def _admit(self, out: SchedulerOutput) -> None:
        if self.scheduling == "static":
            busy = any(r.request_id in self.static_batch
                       for q in (self.running, self.swapped, self.waiting) for r in q)
            if not busy:                                  # form the next batch, FCFS
                self.static_batch, slots = set(), 0
                for r in self.waiting:
                    if slots + r.slots > self.max_num_seqs:
                        break
                    self.static_batch.add(r.request_id)
                    slots += r.slots
        while True:
            req = self._next_candidate()
            if req is None:
                return
            if self.scheduling == "static" and req.request_id not in self.static_batch:
                return
            if self.num_running_slots + req.slots > self.max_num_seqs:
                return
            hits = self._lookup(req)                      # [] unless a cached prefix is found
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            n = self._chunk(req, budget) if budget > 0 else 0
            need = req.num_computed_tokens + n
            if (n == 0 or not self._can_allocate(req, need, hits)
                    or self._prefix_in_flight(req, hits)):
                req.num_computed_tokens -= len(hits) * self.block_size   # looked up again later
                return
            if req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
                self.bm.allocate(req.seq_id, req.num_computed_tokens)   # fresh blocks, no copies
                gpu_blocks = list(self.bm.block_table(req.seq_id))
                out.blocks_to_swap_in.extend(zip(req.swapped_blocks, gpu_blocks))
                self._free_cpu(req)   # the swap-in copy runs before anything reuses these
            else:
                self.waiting.remove(req)
                self._record_hit(req)
            out.copies[req.seq_id] = self._allocate(req, need, hits)
            if self.enable_prefix_caching and req.status != RequestStatus.SWAPPED:
                self.bm.mark_pending(req.seq_id, req.token_ids(0, req.num_tokens), req.cache_salt)
            out.scheduled.append((req, n))
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            if self.clock is not None:
                req.metrics.record_scheduled(self.clock())
