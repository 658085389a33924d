"""The engine loop: add requests, step, collect finished outputs (chapter 04).

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():          # outputs of the requests that finished in this step
            print(out.request_id, out.text)

One `step()` is one iteration of iteration-level scheduling:
  1. the scheduler picks (request, num_new_tokens) pairs within the token budget and plans block
     copies (swap out, swap in, copy-on-write);
  2. the model runner does the copies, runs ONE forward pass over the ragged batch of all
     scheduled tokens, and returns logits for the requests whose step reaches their last token;
  3. the engine forks n > 1 requests after their prompt, samples one token per sequence with its
     own generator, appends it, and finishes sequences on a stop token, a stop string or
     max_tokens, freeing their blocks at once so the next step can use them.

Prefix caching (chapter 06, on by default as in vLLM): the block manager is a
`PrefixCachingBlockManager`; the scheduler looks up cached prefixes at admission and, after each
forward, the engine registers the blocks that became full (`cache_full_blocks`). The cache lives
as long as the engine. `engine.prefix_cache_stats` counts looked-up and hit prompt tokens.

Bad input raises ValueError from `add_request` (the request is not added; nothing else is
affected). `LLM.generate` turns that into an output with finish_reason "error".

Faults during a step belong to ONE request. A request's `num_computed_tokens` advances only
after its work succeeded. If its forward raises (found by re-running the batch one request at a
time), or its sampling, stop check or detokenisation does, it finishes with reason "error" and
the message in `.error`, its blocks are freed, and the other requests' tokens are unchanged. An
exception that escapes `step()` (Ctrl-C, a bug) first requeues every running request for
recompute, so the engine stays consistent: abort what you no longer want, or step on.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from ..cache.blocks import BlockManager, BlockPool
from ..cache.prefix import PrefixCacheStats, PrefixCachingBlockManager
from ..generate import Prompt, check_context_room, prompt_token_ids
from ..metrics import default_clock
from ..sampling import SamplingParams, make_generator
from .model_runner import ModelRunner, kv_blocks_for_memory, sample_tokens
from .outputs import CompletionOutput, RequestOutput, StepOutput, TokenDelta
from .request import Request
from .scheduler import Scheduler



@dataclass(kw_only=True)
class StepStats:
    """What one step did, and a snapshot of the engine after it (for plots, the tests'
    invariants and the server's metrics). Cumulative counters are totals over the engine's life."""
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_prefill_seqs: int           # sequences computing a prompt (or recompute) chunk
    num_preempted: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_free_blocks: int
    num_kv_blocks: int
    duration: float
    total_preemptions: int = 0      # cumulative
    prefix_cache_queries: int = 0   # cumulative prompt tokens looked up (chapter 06)
    prefix_cache_hits: int = 0      # cumulative prompt tokens found
    num_draft_tokens: int = 0       # cumulative drafts verified (chapter 07)
    num_accepted_tokens: int = 0    # cumulative drafts accepted


class LLMEngine:
    def __init__(self, model, tokenizer=None, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None, num_cpu_blocks: Optional[int] = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 scheduling: str = "continuous", preemption: str = "recompute",
                 clock=None, max_step_stats: int = 100_000,
                 speculative_config: Optional[dict] = None):
        if speculative_config is not None:       # chapter 07; validated before anything else
            from .spec_decode import parse_speculative_config
            parse_speculative_config(speculative_config)
        if int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.clock = clock or default_clock
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(model, block_size, max_num_seqs)
        if int(num_kv_blocks) != num_kv_blocks or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks}")
        if num_cpu_blocks is None:
            num_cpu_blocks = num_kv_blocks if preemption == "swap" else 0
        if (isinstance(num_cpu_blocks, bool) or not isinstance(num_cpu_blocks, int)
                or num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be an integer >= 0 (CPU blocks for "
                             f"preemption='swap'), got {num_cpu_blocks!r}")
        if preemption == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption='swap' needs a CPU swap pool: pass num_cpu_blocks >= 1 "
                             "(None sizes it like the GPU pool) or use preemption='recompute'")
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        manager = PrefixCachingBlockManager if self.enable_prefix_caching else BlockManager
        self.block_manager = manager(num_kv_blocks, block_size)
        self.prefix_cache_stats = PrefixCacheStats()     # prompt tokens looked up / hit
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size) if num_cpu_blocks else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   enable_chunked_prefill, scheduling, preemption,
                                   cpu_pool=self.cpu_pool, clock=self.clock,
                                   prefix_cache_stats=self.prefix_cache_stats)
        self.runner = ModelRunner(model, self.block_manager, num_kv_blocks, block_size,
                                  num_cpu_blocks)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else self.config.eos_token_id
        self.groups: dict = {}                   # request_id -> [Request], sample 0 first
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._unreturned: list = []              # finished request ids (abort...) not yet returned
        self.step_stats = collections.deque(maxlen=max_step_stats)
        self.spec = None                         # SpecDecoder when speculating (chapter 07)
        if speculative_config is not None:
            from .spec_decode import SpecDecoder
            self.spec = SpecDecoder(speculative_config, model)

    # --- requests ----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list:
        return prompt_token_ids(prompt, self.tokenizer, self.config.vocab_size)

    def check(self, ids: list, params: SamplingParams) -> None:
        """Raise ValueError (naming the fix) when this request can never be served."""
        p, m = len(ids), params.max_tokens
        check_context_room(self.config, p, m, arg="max_tokens")
        kv_tokens = p + m - 1                    # the last sampled token is never cached
        blocks = -(-kv_tokens // self.block_size)
        if blocks > self.num_kv_blocks:
            fit = self.num_kv_blocks * self.block_size
            raise ValueError(f"the request needs {blocks} KV blocks ({kv_tokens} tokens) but the "
                             f"pool has only {self.num_kv_blocks} ({fit} tokens), so it could "
                             "never run; raise num_kv_blocks or shorten prompt + max_tokens")
        s = self.scheduler
        if not s.enable_chunked_prefill and p > s.max_num_batched_tokens:
            raise ValueError(f"prompt has {p} tokens, more than max_num_batched_tokens "
                             f"({s.max_num_batched_tokens}) and chunked prefill is off; raise "
                             "max_num_batched_tokens or enable_chunked_prefill=True")
        if params.n > s.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={s.max_num_seqs}; "
                             "raise max_num_seqs or lower n")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")

    def add_request(self, request_id: str, prompt: Prompt,
                    params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Queue one request. Raises ValueError for bad input; nothing else is affected.
        cache_salt: requests share cached prefixes only with requests of the same salt (e.g.
        one per tenant), which closes the prefix cache's timing side channel between them."""
        params = params if params is not None else SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string (e.g. a tenant id) or None, "
                             f"got {cache_salt!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()                        # again: fields may have changed since built
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use; pick a unique id")
        ids = self.encode(prompt)
        self.check(ids, params)
        gen = None if params.greedy else make_generator(params.seed, self.model.device)
        req = Request(next(self._seq_ids), request_id, ids, params,
                      arrival_time if arrival_time is not None else self.clock(),
                      next(self._arrivals), gen, prompt=prompt if isinstance(prompt, str) else None,
                      cache_salt=cache_salt)
        self.groups[request_id] = [req]
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        """Finish every sample of the request with reason "abort" and free its blocks. Its
        output is returned by the next step(). False if the id is unknown or already done."""
        group = self.groups.get(request_id)
        if group is None or all(r.is_finished for r in group):
            return False
        now = self.clock()
        for r in group:
            if not r.is_finished:
                self.scheduler.finish(r, "abort")
                r.metrics.finished_time = now
                if self.spec is not None:
                    self.spec.release(r)
        self._unreturned.append(request_id)
        return True

    def release(self, request_ids) -> None:
        """Abort these requests and drop their outputs (finished or not): for a caller that
        gives up on them, like an interrupted `LLM.generate`. Unknown ids are ignored."""
        drop = set(request_ids)
        for rid in drop:
            if rid in self.groups:
                self.abort_request(rid)
                del self.groups[rid]
        self._unreturned = [r for r in self._unreturned if r not in drop]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unreturned)

    has_unfinished_requests = has_unfinished

    # --- one step ----------------------------------------------------------------------------
    def step(self) -> list:
        """Run one iteration. Returns the RequestOutputs of requests finished in it."""
        return self.step_outputs().finished

    @torch.inference_mode()
    def step_outputs(self) -> StepOutput:
        """Run one iteration. Returns a StepOutput: the finished requests' outputs, the new
        tokens of every sequence that got some (TokenDelta) and a StepStats snapshot.

        Failures belong to requests: if the batched forward raises, each request is run alone
        to find which fail; a request whose forward, sampling or stop check raises finishes
        with reason "error" (blocks freed) and the others carry on. If an exception escapes
        anyway (KeyboardInterrupt, a scheduler bug), every running request is requeued to be
        recomputed, so the engine stays consistent and holds no stranded blocks."""
        start = self.clock()
        finished, self._unreturned = self._unreturned, []
        deltas: list = []
        try:
            sched = self.scheduler.schedule()
            if sched.is_empty and self.scheduler.has_unfinished():
                raise RuntimeError(f"the scheduler could not schedule anything although "
                                   f"requests are pending ({self.scheduler.waiting[:3]}...); "
                                   "this is a bug")
            n_decode = sum(n for r, n in sched.scheduled if not r.is_prefill)
            prefill_seqs = sum(r.is_prefill for r, _ in sched.scheduled)
            if not sched.is_empty:
                self._run_step(sched, finished, deltas)
        except BaseException:
            self.scheduler.requeue_all()
            self._unreturned = finished + self._unreturned   # returned by the next step
            raise
        stats = self._stats(sched, n_decode, prefill_seqs, self.clock() - start)
        if not sched.is_empty:
            self.step_stats.append(stats)
        return StepOutput([self._output(rid) for rid in finished], deltas, stats)

    def _stats(self, sched, n_decode: int, prefill_seqs: int, duration: float) -> StepStats:
        s, pc = self.scheduler, self.prefix_cache_stats
        spec = self.spec.stats if self.spec is not None else None
        return StepStats(
            num_batched_tokens=sched.num_batched_tokens,
            num_prefill_tokens=sched.num_batched_tokens - n_decode,
            num_decode_tokens=n_decode, num_seqs=len(sched.scheduled),
            num_prefill_seqs=prefill_seqs, num_preempted=len(sched.preempted),
            num_waiting=len(s.waiting), num_running=len(s.running), num_swapped=len(s.swapped),
            num_free_blocks=self.block_manager.num_free_blocks, num_kv_blocks=self.num_kv_blocks,
            duration=duration, total_preemptions=s.num_preemptions,
            prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0)

    def _run_step(self, sched, finished: list, deltas: list) -> None:
        """Copies, forward, sampling and stop checks of one scheduled step. A request's
        num_computed_tokens advances only once its step's work succeeded: right after the
        forward for a prefill chunk that samples nothing, together with its new token else.
        With speculation (chapter 07) a decode may verify k drafts: its 1 + k logits rows go to
        the SpecDecoder, and the rejected positions are rolled back (counter and blocks)."""
        self.runner.copy_blocks(sched)
        num_spec = {req.seq_id: max(0, req.num_computed_tokens + n - req.num_tokens)
                    for req, n in sched.scheduled}         # drafts verified per request
        if self.spec is not None:
            with self.spec.capture() as cap:
                logits, sampling_reqs = self._forward(sched.scheduled, finished)   # [S, V]
        else:
            logits, sampling_reqs = self._forward(sched.scheduled, finished)       # [S, V]
        n_new = {req.seq_id: n for req, n in sched.scheduled}
        sampling = set(id(r) for r in sampling_reqs)
        for req, n in sched.scheduled:
            if id(req) not in sampling and not req.is_finished:
                req.num_computed_tokens += n         # a prefill chunk: its K/V are cached
                self._cache_full_blocks(req)

        rows = []                               # (request, row of logits) per sequence to sample
        spec_rows = []                          # (request, first row, drafts) to verify
        offset = 0
        for req in sampling_reqs:
            k = num_spec[req.seq_id]
            if k:
                spec_rows.append((req, offset, k))
            else:
                rows.append((req, offset))
                if not req.forked:
                    for child in self._fork(req):
                        rows.append((child, offset))
                        n_new[child.seq_id] = n_new[req.seq_id]
            offset += 1 + k
        tokens = sample_tokens(logits, rows) if rows else []
        emitted = []                            # (request, row of its last token, new tokens)
        for (req, row), token in zip(rows, tokens):
            if isinstance(token, BaseException):
                self._fail(req, f"sampling failed: {type(token).__name__}: {token}", finished)
                continue
            req.num_computed_tokens += n_new[req.seq_id]
            emitted.append((req, row, [token]))
        for req, row, k in spec_rows:
            try:
                toks = self.spec.verify(req, logits[row:row + 1 + k], k)
            except Exception as e:              # noqa: BLE001 - this request's error only
                self._fail(req, f"verification failed: {type(e).__name__}: {e}", finished)
                continue
            rejected = k - (len(toks) - 1)
            req.num_computed_tokens += n_new[req.seq_id] - rejected   # roll back rejected drafts
            self.block_manager.truncate(req.seq_id, req.num_computed_tokens)
            emitted.append((req, row + len(toks) - 1, toks))
        now = self.clock()
        for req, _, toks in emitted:
            reason, before = None, req.num_output_tokens
            for token in toks:
                req.output_token_ids.append(token)
                req.metrics.record_token(now)
                try:
                    reason = self._stop_reason(req, token)
                except Exception as e:          # noqa: BLE001 - this request's error only
                    self._fail(req, f"stop check failed: {type(e).__name__}: {e}", finished)
                    reason = "error"
                    break
                if reason is not None:
                    break
            added = req.num_output_tokens - before
            deltas.append(TokenDelta(req.request_id, req.sample_index,
                                     tuple(req.output_token_ids[-added:]) if added else (),
                                     req.num_output_tokens, reason is not None))
            if reason == "error":
                continue
            # a stop inside the accepted drafts drops the tokens after it: cache only what stays
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self._cache_full_blocks(req)        # never a block holding a rejected draft
            if reason is not None:
                self._finish(req, reason, now, finished)
        if self.spec is not None:               # the next step's drafts
            self._propose(emitted, cap, logits.shape[0], finished)

    def _propose(self, emitted: list, cap, num_rows: int, finished: list) -> None:
        """Drafts for every request that just got tokens and keeps decoding. Drafts only
        change speed, never output, so a proposer error costs nothing but the drafts."""
        hidden = None
        if self.spec.needs_hidden and cap.value is not None and cap.value.shape[1] == num_rows:
            hidden = cap.value[0]                # [S, C] the rows the logits came from
        items = [(req, None if hidden is None else hidden[row])
                 for req, row, _ in emitted if not req.is_finished]
        if self.spec.needs_hidden and hidden is None:
            items = [(req, None) for req, _ in items]
            for req, _ in items:
                req.spec_token_ids, req.spec_draft_probs = [], None
            return
        try:
            self.spec.propose(items)
        except Exception:                       # noqa: BLE001 - decode without drafts
            for req, _ in items:
                req.spec_token_ids, req.spec_draft_probs = [], None

    def _cache_full_blocks(self, req: Request) -> None:
        """Prefix caching: the blocks this step filled hold computed K/V now; register them so
        later requests can share them (never earlier: a failed or preempted step computes
        nothing, and a cached block must hold what its key says)."""
        if self.enable_prefix_caching:
            self.block_manager.cache_full_blocks(req.seq_id, req.num_computed_tokens,
                                                 req.token_ids, req.cache_salt)

    def _forward(self, scheduled: list, finished: list):
        """The step's forward. If the batch raises, run each request alone: the ones that fail
        again finish with reason "error", the others' logits are used as if nothing happened
        (their K/V slots are simply written a second time). Returns (logits [S, V], requests)."""
        try:
            return self.runner.run(scheduled)
        except Exception as e:                  # noqa: BLE001 - attributed below
            if len(scheduled) == 1:             # nothing to bisect: it is this request's
                self._fail(scheduled[0][0], f"forward failed: {type(e).__name__}: {e}", finished)
                return self._no_logits(), []
        rows, reqs = [], []
        for req, n in scheduled:
            try:
                logits, sampling_reqs = self.runner.run([(req, n)])
            except Exception as e:              # noqa: BLE001 - this request's error only
                self._fail(req, f"forward failed: {type(e).__name__}: {e}", finished)
                continue
            rows.append(logits)
            reqs.extend(sampling_reqs)
        return (torch.cat(rows), reqs) if rows else (self._no_logits(), [])

    def _no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.config.vocab_size, device=self.model.device)   # [0, V]

    def _finish(self, req: Request, reason: str, now: float, finished: list) -> None:
        self.scheduler.finish(req, reason)
        req.metrics.finished_time = now
        if self.spec is not None:
            self.spec.release(req)
        group = self.groups[req.request_id]
        if all(r.is_finished for r in group) and req.request_id not in finished:
            finished.append(req.request_id)

    def _fail(self, req: Request, message: str, finished: list) -> None:
        """Finish ONE sequence with reason "error" (its blocks freed); the rest carry on."""
        req.error = message
        self._finish(req, "error", self.clock(), finished)

    def _fork(self, parent: Request) -> list:
        """n > 1: the siblings share the prompt's blocks (refcounts), sampled independently."""
        parent.forked = True
        p = parent.params
        children = []
        for i in range(1, p.n):
            seed = None if p.seed is None else p.seed + i
            gen = None if p.greedy else make_generator(seed, self.model.device)
            child = Request(next(self._seq_ids), parent.request_id, parent.prompt_token_ids, p,
                            parent.metrics.arrival_time, parent.arrival_order, gen,
                            sample_index=i, prompt=parent.prompt, cache_salt=parent.cache_salt)
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            self.groups[parent.request_id].append(child)
            children.append(child)
        return children

    def _stop_reason(self, req: Request, token: int) -> Optional[str]:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id):
            return "stop"
        if p.stop:
            text = self.decode(req.output_token_ids)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                req.text_cut, req.stop_text = min(hits)
                return "stop"
        if req.num_output_tokens >= p.max_tokens:
            return "length"
        return None

    def decode(self, ids: list) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, request_id: str) -> RequestOutput:
        group = sorted(self.groups.pop(request_id), key=lambda r: r.sample_index)
        outs, errors = [], []
        for r in group:
            try:
                text = self.decode(r.output_token_ids)
            except Exception as e:              # noqa: BLE001 - this request's error only
                text, r.finish_reason = "", "error"
                r.error = f"detokenisation failed: {type(e).__name__}: {e}"
            if r.error:
                errors.append(r.error if len(group) == 1 else f"sample {r.sample_index}: {r.error}")
            stop = None
            if r.text_cut is not None:
                text, stop = text[:r.text_cut], r.stop_text
            elif r.finish_reason == "stop" and r.output_token_ids:
                stop = r.output_token_ids[-1]
            outs.append(CompletionOutput(r.sample_index, text, list(r.output_token_ids),
                                         r.finish_reason, r.metrics, stop))
        first = group[0]
        return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), outs, True,
                             "; ".join(errors) or None,
                             num_cached_tokens=first.num_cached_tokens or 0)

    # --- introspection -------------------------------------------------------------------------
    def get_request(self, request_id: str) -> list:
        """The live Request objects of an unfinished request (sample 0 first)."""
        return list(self.groups[request_id])

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def spec_decode_stats(self):
        """Speculative decoding counts over the engine's life (minillm.spec.SpecStats:
        acceptance_rate, mean_accepted_length, acceptance_by_position), or None."""
        return self.spec.stats if self.spec is not None else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no running request holds (vLLM's reset_prefix_cache).
        Returns how many blocks were dropped (0 with prefix caching off)."""
        if not self.enable_prefix_caching:
            return 0
        return self.block_manager.reset_prefix_cache()


__all__ = ["LLMEngine", "StepStats", "StepOutput", "TokenDelta"]
