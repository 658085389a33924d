"""One sequence the engine is serving (chapter 04).

A request's tokens are its prompt followed by what it has generated so far. Its
`num_computed_tokens` counts how many of them have keys and values in the KV cache; the scheduler
moves it towards `num_tokens`, a chunk at a time during prefill and one token per step during
decode. That single counter covers every case the engine meets:

    prefill             num_computed < num_prompt_tokens          (may take several chunks)
    decode              num_computed == num_tokens - 1            (the last sampled token is new)
    recompute after     num_computed reset to 0: prompt + outputs are prefilled again as one
    preemption          longer "prompt", then decoding carries on where it stopped

States: WAITING (never ran, or preempted by recompute and requeued: then it is PREEMPTED),
RUNNING, SWAPPED (preempted by swap: its KV blocks sit in the CPU pool) and FINISHED.
Finish reasons follow vLLM: "stop" (a stop token or stop string), "length" (max_tokens),
"abort" (cancelled by the caller), and "error": this request's step failed (its forward,
sampling, stop check or detokenisation raised); `error` says why, and nobody else is affected.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from ..metrics import RequestMetrics
from ..sampling import SamplingParams, make_generator


class NoGrammar:
    """No structured output: allows every token (the null object until chapter 08's
    engine/structured.py gives a request a real grammar)."""
    active = False

    def allowed(self, vocab_size: int):
        return None                              # no mask

    def accept(self, token: int) -> None:
        pass

    def fork(self) -> "NoGrammar":
        return self


NO_GRAMMAR = NoGrammar()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"      # preempted by recompute: back in the waiting queue, KV freed
    SWAPPED = "swapped"          # preempted by swap: KV in the CPU pool
    FINISHED = "finished"


class Request:
    """One sequence. With SamplingParams.n > 1 the engine forks n - 1 siblings after the
    prompt's prefill; they share the group's `request_id` and differ in `sample_index`."""

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list,
                 params: SamplingParams, arrival_time: float, arrival_order: int,
                 generator: Optional[torch.Generator] = None, sample_index: int = 0,
                 prompt: Optional[str] = None, cache_salt: Optional[str] = None,
                 grammar=None, priority: int = 0):
        self.seq_id = seq_id                       # key in the BlockManager, unique per sequence
        self.request_id = request_id               # the caller's id, shared by the n samples
        self.sample_index = sample_index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list = []
        self.params = params
        self.generator = generator
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_text: Optional[str] = None       # which stop string ended it
        self.text_cut: Optional[int] = None        # len of the text before the stop string
        self.error: Optional[str] = None           # why it finished with reason "error"
        self.arrival_order = arrival_order         # FCFS priority (lower = older)
        self.priority = priority                   # scheduling_policy="priority": lower first
        self.needs_fork = sample_index == 0 and params.n > 1   # siblings come after the prompt
        self.kv = None                             # KVBlocks while it holds blocks: block
                                                   # table, prefix chain (cache/blocks.py)
        self.swapped_blocks: list = []             # CPU block ids while SWAPPED
        self.cache_salt = cache_salt               # prefix-cache namespace (chapter 06)
        self.num_cached_tokens: Optional[int] = None   # prompt tokens hit at first admission
        self.spec_token_ids: list = []             # drafts to verify next step (chapter 07)
        self.spec_draft_probs = None               # their draft distributions [k, V] or None
        self.spec_tree_parents = None              # a tree's parents (node 0 = the last
                                                   # token), or None: the drafts are a chain
        self.draft_state = None                    # the proposer's state for this sequence
        self.logprobs: list = []                   # per output token {id: (logprob, rank)}
        self.prompt_logprobs: list = [None]        # per prompt token (the first has none)
        self.grammar = grammar if grammar is not None else NO_GRAMMAR   # chapter 08's mask
        self.metrics = RequestMetrics(arrival_time=arrival_time,
                                      num_prompt_tokens=len(self.prompt_token_ids),
                                      sample_index=sample_index)

    # --- token bookkeeping -------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is still missing from the cache (also true while
        recomputing after a preemption)."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a request computes its
        whole prompt instead of starting on cached blocks (as vLLM does)."""
        return self.params.prompt_logprobs is not None

    def token_ids(self, start: int, end: int) -> list:
        """Tokens [start, end); positions past num_tokens are the drafts (chapter 07)."""
        if end > self.num_tokens:
            n = self.num_tokens
            return self.token_ids(start, n) + self.spec_token_ids[:end - n]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def slots(self) -> int:
        """Sequences this request will occupy in the running batch (n before it forks)."""
        return self.params.n if self.needs_fork else 1

    def fork(self, seq_id: int, sample_index: int) -> "Request":
        """Sibling sample_index of this request (n > 1), at the same point: same tokens, same
        computed prefix, its own generator (seed + sample_index when seeded)."""
        p = self.params
        gen = None
        if not p.greedy:
            gen = make_generator(None if p.seed is None else p.seed + sample_index,
                                 self.generator.device if self.generator is not None else "cpu")
        child = Request(seq_id, self.request_id, self.prompt_token_ids, p,
                        self.metrics.arrival_time, self.arrival_order, gen,
                        sample_index=sample_index, prompt=self.prompt, cache_salt=self.cache_salt,
                        grammar=self.grammar.fork(), priority=self.priority)
        child.output_token_ids = list(self.output_token_ids)
        child.logprobs = list(self.logprobs)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        return child

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def sort_key(self):
        """The scheduler's order everywhere (queues, admission, preemption victim = the last):
        priority first (always 0 under FCFS), then arrival, then sample."""
        return (self.priority, self.arrival_order, self.sample_index)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}#{self.sample_index}, {self.status.value}, "
                f"computed {self.num_computed_tokens}/{self.num_tokens}, "
                f"out {self.num_output_tokens}/{self.params.max_tokens})")
