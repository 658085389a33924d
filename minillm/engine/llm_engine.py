"""The engine loop: add requests, step, collect outputs (chapter 04).

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():          # outputs of the requests that finished in this step
            print(out.request_id, out.text)

One `step()` is one iteration of iteration-level scheduling, in three calls (vLLM v1's
schedule -> execute_model -> update_from_output, nano-vllm's schedule / run / postprocess):

    sched  = scheduler.schedule()                  who computes how many tokens; block copies;
                                                   the n > 1 siblings forked this step
    result = runner.execute(sched)                 copies, ONE forward over the ragged batch,
                                                   sampled (or verified) tokens per sequence
    update = scheduler.update_from_output(...)     append, roll back rejected drafts, stop,
                                                   register full blocks, free finished requests

then, with speculative decoding (chapter 07), the proposer drafts the next tokens of every
request that keeps decoding (`propose`: a proposer that proposes nothing when speculation is
off). `step_outputs()` returns the same step as a StepOutput: the finished requests' outputs,
the new tokens of every sequence that got some (TokenDelta, what a server streams) and a
StepStats snapshot (what a metrics exporter reads).

Prefix caching (chapter 06, on by default as in vLLM) is a flag of the block manager; the
cache lives as long as the engine. `engine.prefix_cache_stats` counts looked-up and hit prompt
tokens.

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
from dataclasses import dataclass
from typing import Optional

import torch

from ..cache.blocks import BlockManager, BlockPool, NoKVConnector
from ..cache.paged import resolve_kv_cache_dtype
from ..cache.prefix import PrefixCacheStats
from ..generate import Prompt, check_context_room, prompt_token_ids, stop_reason
from ..metrics import default_clock
from ..sampling import SamplingParams, make_generator
from .cuda_graphs import check_enforce_eager
from .executor import build_executor
from .model_runner import kv_blocks_for_memory
from .outputs import CompletionOutput, Logprob, RequestOutput, StepOutput, TokenDelta
from .request import Request
from .scheduler import Scheduler, StepUpdate
from .spec_decode import DraftRequest, build_proposer, check_drafts, parse_speculative_config, room



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
                 speculative_config: Optional[dict] = None,
                 kv_transfer_config: Optional[dict] = None, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = True, scheduling_policy: str = "fcfs",
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        check_enforce_eager(enforce_eager)       # chapter 12: CUDA graphs for decode steps
        # chapter 07; validated before anything else. No drafts in a step while more than
        # disable_by_batch_size requests are running (None: speculate at every batch size)
        self.disable_by_batch_size = (None if speculative_config is None else
                                      parse_speculative_config(speculative_config)
                                      ["disable_by_batch_size"])
        resolve_kv_cache_dtype(kv_cache_dtype, model.dtype, model.device)   # ch. 09: "fp8"
        if int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.clock = clock or default_clock
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(model, block_size, max_num_seqs,
                                                 kv_cache_dtype)
        if int(num_kv_blocks) != num_kv_blocks or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks}")
        num_cpu_blocks = self._check_cpu_blocks(num_cpu_blocks, num_kv_blocks, preemption)
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.block_manager = BlockManager(num_kv_blocks, block_size, bool(enable_prefix_caching))
        self.prefix_cache_stats = PrefixCacheStats()     # prompt tokens looked up / hit
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size) if num_cpu_blocks else None
        self.kv_connector = self._build_kv_connector(kv_transfer_config, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   enable_chunked_prefill, scheduling, preemption,
                                   cpu_pool=self.cpu_pool, clock=self.clock,
                                   prefix_cache_stats=self.prefix_cache_stats,
                                   kv_connector=self.kv_connector,
                                   scheduling_policy=scheduling_policy)
        self.proposer = build_proposer(speculative_config, model)   # proposes nothing when off
        # who runs the forward: one ModelRunner here, or chapter 10's tensor / pipeline workers
        self.executor = build_executor(tensor_parallel_size, model, self.block_manager,
                                       num_kv_blocks, block_size, num_cpu_blocks,
                                       needs_hidden=self.proposer.needs_hidden,
                                       needs_features=self.proposer.needs_features,
                                       kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
                                       max_num_seqs=max_num_seqs,
                                       pipeline_parallel_size=pipeline_parallel_size)
        self.runner = self.executor.driver_runner          # rank 0's runner (the only one at 1)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else self.config.eos_token_id
        self.groups: dict = {}                   # request_id -> [Request], sample 0 first
        self._arrivals = 0
        self._unreturned: list = []              # finished request ids (abort...) not yet returned
        self.step_stats = collections.deque(maxlen=max_step_stats)
        self.spec_stats = None                   # SpecStats when speculating (chapter 07)
        self._structured = None                  # StructuredOutputManager, on first grammar
        if speculative_config is not None:
            from ..spec.stats import SpecStats
            self.spec_stats = SpecStats()

    @staticmethod
    def _check_cpu_blocks(num_cpu_blocks, num_kv_blocks: int, preemption: str) -> int:
        if num_cpu_blocks is None:
            num_cpu_blocks = num_kv_blocks if preemption == "swap" else 0
        if (isinstance(num_cpu_blocks, bool) or not isinstance(num_cpu_blocks, int)
                or num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be an integer >= 0 (CPU blocks for "
                             f"preemption='swap'), got {num_cpu_blocks!r}")
        if preemption == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption='swap' needs a CPU swap pool: pass num_cpu_blocks >= 1 "
                             "(None sizes it like the GPU pool) or use preemption='recompute'")
        return num_cpu_blocks

    def _build_kv_connector(self, kv_transfer_config, enable_prefix_caching):
        """Chapter 11: KV from outside the pool. None: NoKVConnector (finds nothing). A dict
        {"kv_connector": "disk", "path": ..., "max_bytes": ...}: a disk tier under the prefix
        cache, which the pool tells about every cached block it evicts. A connector object
        (lookup / request_finished / clear, e.g. serve/disagg.py's): used as it is."""
        if kv_transfer_config is None:
            return NoKVConnector()
        if not isinstance(kv_transfer_config, dict):
            return kv_transfer_config
        if not enable_prefix_caching:
            raise ValueError("a KV tier keeps blocks the prefix cache evicts; it needs "
                             "enable_prefix_caching=True")
        from ..cache.tier import parse_kv_transfer_config
        tier = parse_kv_transfer_config(kv_transfer_config, self.block_size)
        self.block_manager.pool.evict_listeners.append(self._save_to_tier)
        return tier

    def _save_to_tier(self, block_id: int, entry) -> None:
        k, v = self.runner.cache.swap_out([block_id])          # [L, 1, block_size, KVH, D]
        parent = entry.parent.key if entry.parent is not None else None
        self.kv_connector.save(entry.key, entry.token_ids, parent,
                               entry.cache_salt if parent is None else None, k[:, 0], v[:, 0])

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
                    cache_salt: Optional[str] = None, priority: int = 0) -> None:
        """Queue one request. Raises ValueError for bad input; nothing else is affected.
        priority (scheduling_policy="priority" only): lower values run first, ties FCFS.
        cache_salt: requests share cached prefixes only with requests of the same salt (e.g.
        one per tenant), which closes the prefix cache's timing side channel between them."""
        params = params if params is not None else SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string (e.g. a tenant id) or None, "
                             f"got {cache_salt!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if priority != 0 and self.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority={priority!r} needs scheduling_policy='priority' "
                             "(the engine is FCFS)")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        params.validate()                        # again: fields may have changed since built
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use; pick a unique id")
        ids = self.encode(prompt)
        self.check(ids, params)
        grammar = self._grammar(params)
        gen = None if params.greedy else make_generator(params.seed, self.model.device)
        self._arrivals += 1
        req = Request(self.scheduler.new_seq_id(), request_id, ids, params,
                      arrival_time if arrival_time is not None else self.clock(),
                      self._arrivals, gen, prompt=prompt if isinstance(prompt, str) else None,
                      cache_salt=cache_salt, grammar=grammar, priority=priority)
        self.groups[request_id] = [req]
        self.scheduler.add(req)

    def _grammar(self, params: SamplingParams):
        """The request's grammar matcher (chapter 08's engine/structured.py), or None: no mask.
        ValueError for a grammar that is invalid or matches nothing."""
        if params.structured_outputs is None:
            return None
        if self._structured is None:
            from .structured import StructuredOutputManager
            self._structured = StructuredOutputManager(self.tokenizer, self.config.vocab_size,
                                                       self.eos_token_id)
        return self._structured.grammar(params.structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        """Finish every sample of the request with reason "abort" and free its blocks. Its
        output is returned by the next step(). False if the id is unknown or already done."""
        group = self.groups.get(request_id)
        if group is None or all(r.is_finished for r in group):
            return False
        for r in group:
            if not r.is_finished:
                self.scheduler.finish(r, "abort")
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
        """Run one iteration: schedule -> execute -> update, then draft (chapter 07). Returns
        the finished requests' outputs, every sequence's new tokens and a StepStats snapshot.

        If an exception escapes anyway (KeyboardInterrupt, a scheduler bug), every running
        request is requeued to be recomputed, so the engine stays consistent and holds no
        stranded blocks; outputs finished before it are returned by the next step."""
        start = self.clock()
        finished, self._unreturned = self._unreturned, []
        try:
            sched = self.scheduler.schedule()
            self._check_progress(sched)
            stats = self._scheduled_stats(sched)
            update = StepUpdate()
            if not sched.is_empty:
                result = self.executor.execute_model(sched)
                update = self.scheduler.update_from_output(sched, result, self._check_stop)
                self._record_logprobs(sched, update, result)
                self._record_spec(result)
                self._propose(update, result.hidden, result.features)
        except BaseException:
            self.scheduler.requeue_all()
            self._unreturned = finished + self._unreturned   # returned by the next step
            raise
        finished += self._finished_ids(update.finished, finished)
        return self._step_output(sched, stats, update, finished, self.clock() - start)

    def _check_progress(self, sched) -> None:
        """Record this step's forks in their groups; an empty plan with requests pending is a
        bug."""
        for child, parent in sched.forks:
            self.groups[parent.request_id].append(child)
        if sched.is_empty and self.scheduler.has_unfinished():
            raise RuntimeError(f"the scheduler could not schedule anything although requests "
                               f"are pending ({self.scheduler.waiting[:3]}...); this is a bug")

    def _check_stop(self, req: Request):
        """The one stop rule (generate.stop_reason) with this engine's EOS and detokeniser."""
        return stop_reason(req.params, req.output_token_ids, self.eos_token_id,
                           decode=self.decode if req.params.stop else None)

    @staticmethod
    def _record_logprobs(sched, update: StepUpdate, result) -> None:
        """Keep the runner's logprobs for the tokens the update kept (a stop inside a step's
        tokens drops the rest) and the prompt positions computed in this step."""
        for req, toks in update.emitted:
            report = result.logprobs.get(req.seq_id)
            if report:
                req.logprobs.extend(report[:len(toks)])
        for req, _ in sched.scheduled:
            pos, report = result.prompt_logprobs.get(req.seq_id, (None, None))
            if pos == len(req.prompt_logprobs) and req.seq_id not in result.errors:
                req.prompt_logprobs.extend(report)

    def _record_spec(self, result) -> None:
        for seq_id, k in result.num_drafts.items():
            self.spec_stats.record(k, len(result.sampled[seq_id]) - 1,      # a tree: its depth
                                   result.tree_depths.get(seq_id), result.paths.get(seq_id))

    def _propose(self, update: StepUpdate, hidden: dict, features: dict = None) -> None:
        """Drafts for every request that just got tokens and keeps decoding. Drafts only
        change speed, never output, so a proposer error costs nothing but the drafts."""
        live = [req for req, _ in update.emitted if not req.is_finished]
        for req in live:                        # the drafts just verified are spent
            req.spec_token_ids, req.spec_draft_probs, req.spec_tree_parents = [], None, None
        live = [req for req in live if req.params.allows_drafts]   # no penalties, no grammar
        if not live or self.proposer.num_speculative_tokens == 0:
            return
        if self.proposer.needs_hidden and any(r.seq_id not in hidden for r in live):
            live = []                           # no hidden state this step: decode plainly
        k_max, ctx = self.proposer.num_speculative_tokens, self.config.max_position_embeddings
        todo = [(req, room(req, k_max, ctx)) for req in live]
        todo = [(req, k) for req, k in todo if k > 0]
        off = (self.disable_by_batch_size is not None
               and len(self.scheduler.running) > self.disable_by_batch_size)
        asks = [DraftRequest(req.prompt_token_ids + req.output_token_ids, 0 if off else k,
                             req.params, req.generator, hidden.get(req.seq_id), req.draft_state,
                             (features or {}).get(req.seq_id),
                             max_nodes=ctx - req.num_tokens)      # a tree's slots: the context
                for req, k in todo]
        if off:                                 # the batch is too big to verify drafts: none
            self._observe(todo, asks)           # this step (a proposer that keeps state sees
            return                              # the new tokens all the same)
        try:
            drafts = check_drafts(asks, self.proposer.propose(asks), self.proposer)
        except Exception:                       # noqa: BLE001 - decode without drafts
            drafts = [None] * len(todo)
        for (req, _), d in zip(todo, drafts):
            req.spec_token_ids = list(d.token_ids) if d is not None else []
            req.spec_draft_probs = d.probs if d is not None else None
            req.draft_state = d.state if d is not None else None
            req.spec_tree_parents = d.parents if d is not None else None

    def _observe(self, todo: list, asks: list) -> None:
        """A step without drafts (disable_by_batch_size): a proposer with `observe` (EAGLE's,
        whose drafter must see the target's features of every position, and would otherwise
        recompute them all when drafting resumes) takes this step's tokens and features."""
        self.spec_stats.num_steps_off += 1
        if not asks or not hasattr(self.proposer, "observe"):
            return
        try:
            states = self.proposer.observe(asks)
        except Exception:                       # noqa: BLE001 - drafts only: forget the state
            states = [None] * len(todo)
        for (req, _), state in zip(todo, states):
            req.draft_state = state

    def _finished_ids(self, reqs: list, already: list) -> list:
        """Request ids whose every sample has now finished (each once)."""
        ids = []
        for req in reqs:
            rid = req.request_id
            if (rid not in ids and rid not in already
                    and all(r.is_finished for r in self.groups[rid])):
                ids.append(rid)
        return ids

    def _scheduled_stats(self, sched) -> dict:
        """What the plan holds, counted before the update moves num_computed_tokens."""
        n_decode = sum(n for r, n in sched.scheduled if not r.is_prefill)
        return dict(num_batched_tokens=sched.num_batched_tokens,
                    num_prefill_tokens=sched.num_batched_tokens - n_decode,
                    num_decode_tokens=n_decode, num_seqs=len(sched.scheduled),
                    num_prefill_seqs=sum(r.is_prefill for r, _ in sched.scheduled),
                    num_preempted=len(sched.preempted))

    def _step_output(self, sched, planned: dict, update: StepUpdate, finished: list,
                     duration: float) -> StepOutput:
        s, pc, spec = self.scheduler, self.prefix_cache_stats, self.spec_stats
        stats = StepStats(
            **planned, num_waiting=len(s.waiting), num_running=len(s.running),
            num_swapped=len(s.swapped), num_free_blocks=self.block_manager.num_free_blocks,
            num_kv_blocks=self.num_kv_blocks, duration=duration,
            total_preemptions=s.num_preemptions, prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0)
        if not sched.is_empty:
            self.step_stats.append(stats)
        deltas = [TokenDelta(request_id=req.request_id, index=req.sample_index,
                             token_ids=tuple(toks), num_output_tokens=req.num_output_tokens,
                             finished=req.is_finished,
                             logprobs=tuple(req.logprobs[len(req.logprobs) - len(toks):]
                                            if req.params.logprobs is not None else ()))
                  for req, toks in update.emitted]
        return StepOutput(finished=[self._output(rid) for rid in finished], deltas=deltas,
                          stats=stats)

    def decode(self, ids: list) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, request_id: str) -> RequestOutput:
        group = sorted(self.groups.pop(request_id), key=lambda r: r.sample_index)
        outs = [self._completion(r) for r in group]
        errors = [r.error if len(group) == 1 else f"sample {r.sample_index}: {r.error}"
                  for r in group if r.error]
        first = group[0]
        prompt_lp = None
        if first.params.prompt_logprobs is not None:
            prompt_lp = [None] + [self.logprob_dict(d) for d in first.prompt_logprobs[1:]]
        return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), outs, True,
                             "; ".join(errors) or None,
                             num_cached_tokens=first.num_cached_tokens or 0,
                             prompt_logprobs=prompt_lp)

    def logprob_dict(self, report: dict) -> dict:
        """{id: (logprob, rank)} from the runner -> {id: Logprob} with each token's text."""
        return {t: Logprob(lp, rank, self.decode_token(t)) for t, (lp, rank) in report.items()}

    def decode_prompt(self, ids: list) -> str:
        """A token-id prompt's text, special tokens kept (what `echo` puts back)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    def check_grammar(self, params: SamplingParams) -> None:
        """ValueError if params.structured_outputs is invalid or matches nothing (add_request
        checks it too; a server calls this first to answer 400 before queueing)."""
        self._grammar(params)

    def decode_token(self, token: int) -> str:
        """One token's own text (special tokens included), as logprobs reports show it."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _completion(self, r: Request) -> CompletionOutput:
        """One sample's output: text cut before a stop string, what stopped it."""
        try:
            text = self.decode(r.output_token_ids)
        except Exception as e:                  # noqa: BLE001 - this request's error only
            text, r.finish_reason = "", "error"
            r.error = f"detokenisation failed: {type(e).__name__}: {e}"
        stop = None
        if r.text_cut is not None:
            text, stop = text[:r.text_cut], r.stop_text
        elif r.finish_reason == "stop" and r.output_token_ids:
            stop = r.output_token_ids[-1]
        lps = cum = None
        if r.params.logprobs is not None:
            lps = [self.logprob_dict(d) for d in r.logprobs]
            cum = sum(d[t].logprob for d, t in zip(lps, r.output_token_ids))
        return CompletionOutput(r.sample_index, text, list(r.output_token_ids), r.finish_reason,
                                r.metrics, stop, lps, cum)

    # --- introspection -------------------------------------------------------------------------
    def get_request(self, request_id: str) -> list:
        """The live Request objects of an unfinished request (sample 0 first)."""
        return list(self.groups[request_id])

    @property
    def enable_prefix_caching(self) -> bool:
        return self.block_manager.enable_caching

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def spec_decode_stats(self):
        """Speculative decoding counts over the engine's life (minillm.spec.SpecStats:
        acceptance_rate, mean_accepted_length, acceptance_by_position), or None."""
        return self.spec_stats

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if it has any (tensor parallelism)."""
        self.executor.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no running request holds (vLLM's reset_prefix_cache).
        Returns how many blocks were dropped (0 with prefix caching off); a KV tier (chapter
        11) is emptied too, since its blocks were computed by the same weights."""
        return self.block_manager.reset_prefix_cache() + self.kv_connector.clear()


__all__ = ["LLMEngine", "StepStats", "StepOutput", "TokenDelta"]
