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

Admission always asks the block manager for the longest cached prefix of the request's tokens
(`find_cached_blocks`): until chapter 06 turns prefix caching on, it finds nothing. With hits the
request's num_computed_tokens starts after them and the hit blocks count against the pool (a hit
on a free cached block takes it out of the free queue). A request whose next block is being
computed by a running request right now waits for it (like a request that does not fit) rather
than compute the same prefix twice.

A step has two halves here, as in vLLM v1:
  schedule()            plans: (request, num_new_tokens) pairs, the block copies the model runner
                        does first (swap out, swap in, copy-on-write), and the n > 1 siblings
                        forked from a request whose prompt completes in this step;
  update_from_output()  applies what the runner returned: appends the new tokens, rolls back
                        rejected drafts (chapter 07), checks stops, registers full blocks with the
                        prefix cache and frees finished requests.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..cache.blocks import NoKVConnector
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)           # [(Request, num_new_tokens)]
    copies: dict = field(default_factory=dict)               # seq_id -> [(src, dst)] copy-on-write
    blocks_to_swap_out: list = field(default_factory=list)   # [(gpu_block, cpu_block)]
    blocks_to_swap_in: list = field(default_factory=list)    # [(cpu_block, gpu_block)]
    kv_loads: list = field(default_factory=list)  # [(block_ids, [(k, v)])] from outside (ch. 11)
    preempted: list = field(default_factory=list)            # [Request]
    forks: list = field(default_factory=list)                # [(child, parent)] n > 1 siblings

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def blocks_to_copy(self) -> list:
        return [pair for pairs in self.copies.values() for pair in pairs]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepUpdate:
    """What update_from_output did: the tokens each sequence got, the sequences that finished."""
    emitted: list = field(default_factory=list)             # [(Request, [new token ids])]
    finished: list = field(default_factory=list)            # [Request]


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 scheduling: str = "continuous", preemption: str = "recompute",
                 cpu_pool=None, clock=None, prefix_cache_stats=None, kv_connector=None,
                 scheduling_policy: str = "fcfs"):
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{scheduling_policy!r}")
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
        # "priority" (vLLM's name): every queue is ordered by Request.sort_key = (priority,
        # arrival), so a lower priority value is admitted first and the preemption victim
        # (running[-1]) is the lowest-priority, newest request. Under "fcfs" priority stays 0.
        self.scheduling_policy = scheduling_policy
        self.cpu_pool = cpu_pool
        self.clock = clock
        self.prefix_cache_stats = prefix_cache_stats        # prompt tokens looked up / hit
        # chapter 11: KV from outside the pool (a disk tier, a prefill engine); off: finds none
        self.kv_connector = kv_connector if kv_connector is not None else NoKVConnector()
        self.waiting: list = []      # sorted by arrival: preempted (older) ones first
        self.running: list = []      # sorted by arrival
        self.swapped: list = []      # sorted by arrival
        self.static_batch: set = set()   # request ids of the current static batch
        self.num_preemptions = 0
        self.num_swap_outs = 0          # preemptions that went to the CPU pool
        self._seq_ids = itertools.count()

    def new_seq_id(self) -> int:
        """A fresh key for the block manager (one per sequence, siblings included)."""
        return next(self._seq_ids)

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

    def finish(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        """Remove a request from whichever queue holds it, free its blocks, drop its drafts."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if self.bm.has(req.seq_id):
            req.finish_reason = reason
            self.kv_connector.request_finished(req)        # chapter 11: e.g. send its KV
            self._free_blocks(req)
        self._free_cpu(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error if error is not None else req.error
        req.spec_token_ids, req.spec_draft_probs, req.draft_state = [], None, None
        req.spec_tree_parents = None
        if self.clock is not None:
            req.metrics.finished_time = self.clock()

    def requeue_all(self) -> None:
        """Send every running and swapped request back to the waiting queue to be recomputed
        from scratch (blocks freed, num_computed_tokens 0, outputs kept). The engine calls this
        when a step fails half-way: whatever the step had copied or written, recomputing is
        correct, and no block stays held by a request that is not running."""
        for req in self.running + self.swapped:
            if self.bm.has(req.seq_id):
                self._free_blocks(req)
            self._free_cpu(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
        self.running, self.swapped = [], []

    def _allocate(self, req: Request, num_tokens: int, hits=()) -> list:
        """Grow req's blocks to num_tokens (starting on prefix hits if new); returns the
        copy-on-write pairs. req.kv is its KVBlocks record: block table, prefix chain."""
        copies = self.bm.allocate(req.seq_id, num_tokens, hits)
        req.kv = self.bm.kv(req.seq_id)
        return copies

    def _free_blocks(self, req: Request) -> None:
        self.bm.free(req.seq_id)
        req.kv = None

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
        decodes_left = len(order) - sum(r.is_prefill for r in order)
        for req in order:
            if req.status != RequestStatus.RUNNING:       # preempted earlier in this step
                continue
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget == 0:
                break
            n = self._chunk_size(req.num_uncomputed_tokens, budget)
            if n == 0:
                continue
            if not req.is_prefill:
                decodes_left -= 1
                n += self._num_spec(req, budget - decodes_left - n)
            self._reserve(req, n, out)

        # 2. admissions, only when nobody was preempted in this step.
        if not out.preempted:
            self._admit(out)
        self._fork_siblings(out)
        return out

    def _chunk_size(self, num_uncomputed: int, budget: int) -> int:
        """How many of num_uncomputed tokens to schedule with `budget` tokens left (0: wait)."""
        if num_uncomputed <= budget:
            return num_uncomputed
        if self.enable_chunked_prefill or num_uncomputed > self.max_num_batched_tokens:
            return budget
        return 0

    def _num_spec(self, req: Request, budget: int) -> int:
        """Speculative drafts (chapter 07) that ride along with a decode: as many as the budget
        leaves (every other decode keeps its slot) and only if the blocks are free, so drafts
        never cause a preemption. Positions past num_tokens are drafts (Request.token_ids)."""
        k = min(len(req.spec_token_ids), max(0, budget))
        while k and not self.bm.can_allocate(req.seq_id, req.num_tokens + k):
            k -= 1
        return k

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for n more tokens of a running request, preempting the newest running
        requests while the pool is short. False when req had to preempt itself."""
        need = req.num_computed_tokens + n
        while not self.bm.can_allocate(req.seq_id, need):
            victim = self.running[-1]                     # arrived last
            self._preempt(victim, out)
            if victim is req:
                return False
        out.copies[req.seq_id] = self._allocate(req, need)
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
            self._free_blocks(victim)
            victim.swapped_blocks = cpu_blocks
            victim.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
            bisect.insort(self.swapped, victim, key=lambda r: r.sort_key)
        else:
            self._free_blocks(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            bisect.insort(self.waiting, victim, key=lambda r: r.sort_key)

    def _next_candidate(self) -> Optional[Request]:
        heads = [q[0] for q in (self.swapped, self.waiting) if q]
        return min(heads, key=lambda r: r.sort_key) if heads else None

    # --- admission -------------------------------------------------------------------------------
    def _record_hit(self, req: Request) -> None:
        """Count the prompt's lookup once, at the request's first admission (vLLM's stats)."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
            if self.prefix_cache_stats is not None and self.bm.enable_caching:
                self.prefix_cache_stats.record(req.num_prompt_tokens, req.num_cached_tokens)

    def _form_static_batch(self) -> None:
        """Static scheduling: once the last batch is gone, the next one is the oldest requests
        that fit max_num_seqs; nobody else is admitted until it has finished."""
        busy = any(r.request_id in self.static_batch
                   for q in (self.running, self.swapped, self.waiting) for r in q)
        if not busy:
            self.static_batch, slots = set(), 0
            for r in self.waiting:
                if slots + r.slots > self.max_num_seqs:
                    break
                self.static_batch.add(r.request_id)
                slots += r.slots

    def _admit(self, out: SchedulerOutput) -> None:
        """Admit swapped and waiting requests, oldest first, until one does not fit."""
        if self.scheduling == "static":
            self._form_static_batch()
        while True:
            req = self._next_candidate()
            if req is None or self.num_running_slots + req.slots > self.max_num_seqs:
                return
            if self.scheduling == "static" and req.request_id not in self.static_batch:
                return
            swapped = req.status == RequestStatus.SWAPPED
            tokens = req.token_ids(0, req.num_tokens)
            # the longest cached prefix ([] with prefix caching off, or for a swapped request)
            skip = swapped or req.skip_reading_prefix_cache      # prompt logprobs: compute all
            hits = [] if skip else self.bm.find_cached_blocks(tokens, req.cache_salt)
            # and the tokens after them found outside the pool (none until chapter 11)
            found, loads = (0, []) if skip else self.kv_connector.lookup(req, tokens, len(hits))
            computed = req.num_computed_tokens + len(hits) * self.block_size + found
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            n = self._chunk_size(req.num_tokens - computed, budget) if budget > 0 else 0
            if (n == 0 or not self.bm.can_allocate(req.seq_id, computed + n, hits)
                    or self.bm.is_computing(tokens, hits, req.cache_salt)):
                return
            if swapped:
                self._swap_in(req, out)
            else:
                self.waiting.remove(req)
                req.num_computed_tokens = computed
                self._record_hit(req)
            out.copies[req.seq_id] = self._allocate(req, computed + n, hits)
            if loads:                     # the runner writes them in before the forward
                out.kv_loads.append((req.kv.block_ids[len(hits):len(hits) + len(loads)], loads))
            if not swapped:
                self.bm.mark_pending(req.seq_id, tokens, req.cache_salt)
            out.scheduled.append((req, n))
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            if self.clock is not None:
                req.metrics.record_scheduled(self.clock())

    def _swap_in(self, req: Request, out: SchedulerOutput) -> None:
        """Fresh device blocks for a swapped request, filled from the CPU pool before the step."""
        self.swapped.remove(req)
        self._allocate(req, req.num_computed_tokens)               # fresh blocks, no copies
        gpu_blocks = list(self.bm.block_table(req.seq_id))
        out.blocks_to_swap_in.extend(zip(req.swapped_blocks, gpu_blocks))
        self._free_cpu(req)   # the swap-in copy runs before anything reuses these

    # --- n > 1: siblings share the prompt's blocks --------------------------------------------
    def _fork_siblings(self, out: SchedulerOutput) -> None:
        """A request with n > 1 whose prompt completes in this step gets its n - 1 siblings now:
        they share its blocks (refcounts), sample from the same logits row with their own
        generators, and run as independent sequences from then on."""
        for req, n in list(out.scheduled):
            if not req.needs_fork or req.num_computed_tokens + n < req.num_tokens:
                continue
            req.needs_fork = False
            for i in range(1, req.params.n):
                child = req.fork(self.new_seq_id(), i)
                self.bm.fork(req.seq_id, child.seq_id)
                child.kv = self.bm.kv(child.seq_id)
                self.add_running(child)
                out.forks.append((child, req))

    # --- after the forward ------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result,
                           check_stop: Callable) -> StepUpdate:
        """Apply what the model runner returned for `sched` (a ModelRunnerOutput):

            error       the sequence finishes with reason "error"; nobody else is affected
            no tokens   a prefill chunk: its K/V are cached, num_computed_tokens moves on
            tokens      appended one by one until check_stop(req) says stop; drafts the target
                        rejected are rolled back (num_computed_tokens and blocks)
        then full blocks are registered with the prefix cache (only blocks of kept tokens) and
        finished sequences are freed. A request's num_computed_tokens moves only here, after its
        work succeeded."""
        update = StepUpdate()
        n_new = {req.seq_id: n for req, n in sched.scheduled}
        n_new.update({child.seq_id: n_new[parent.seq_id] for child, parent in sched.forks})
        for req in [r for r, _ in sched.scheduled] + [c for c, _ in sched.forks]:
            if req.is_finished:
                continue
            error = result.errors.get(req.seq_id)
            tokens = result.sampled.get(req.seq_id)
            if error is None and tokens is None:         # a prefill chunk that samples nothing
                req.num_computed_tokens += n_new[req.seq_id]
            elif error is None:
                error = self._accept(req, n_new[req.seq_id], tokens,
                                     result.num_drafts.get(req.seq_id, 0), check_stop, update)
            if error is not None:
                self.finish(req, "error", error)
                update.finished.append(req)
                continue
            self.bm.cache_full_blocks(req.seq_id, req.num_computed_tokens, req.token_ids,
                                      req.cache_salt)
            if req.finish_reason is not None:
                self.finish(req, req.finish_reason)
                update.finished.append(req)
        return update

    def _accept(self, req: Request, n: int, tokens: list, num_drafts: int,
                check_stop: Callable, update: StepUpdate) -> Optional[str]:
        """Append a sequence's new tokens (stopping early on a stop); None, or the error."""
        rejected = num_drafts - (len(tokens) - 1)
        req.num_computed_tokens += n - rejected          # roll back the rejected drafts
        if rejected:
            self.bm.truncate(req.seq_id, req.num_computed_tokens)
        req.metrics.num_draft_tokens += num_drafts
        req.metrics.num_accepted_tokens += len(tokens) - 1
        now = self.clock() if self.clock is not None else 0.0
        added = []
        for token in tokens:
            req.output_token_ids.append(token)
            req.metrics.record_token(now)
            added.append(token)
            try:
                stop = check_stop(req)
            except Exception as e:                       # noqa: BLE001 - this request's error only
                update.emitted.append((req, added))
                return f"stop check failed: {type(e).__name__}: {e}"
            if stop is not None:
                req.finish_reason, req.text_cut = stop.reason, stop.text_cut
                req.stop_text = stop.stop if stop.text_cut is not None else None
                break
        update.emitted.append((req, added))
        # a stop inside the accepted drafts drops the tokens after it: cache only what stays
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        return None
