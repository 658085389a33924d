"""The serving engine (chapters 04-06): requests, scheduler, model runner, LLMEngine, LLM.

Chapter 06 adds prefix caching (on by default): the block manager becomes
`cache.prefix.PrefixCachingBlockManager`, the scheduler looks up cached prefixes at admission,
and the engine registers full blocks after each successful step.

    request.py       Request: prompt + outputs, num_computed_tokens chasing num_tokens, states
    scheduler.py     FCFS, token budget, chunked prefill, static vs continuous, preemption
    model_runner.py  one ragged batch per step over the paged KV cache; batched sampling
    llm_engine.py    add_request / step / has_unfinished / abort_request
    llm.py           LLM.generate(prompts, sampling_params): the offline batch API
    outputs.py       RequestOutput / CompletionOutput

Recording or replaying a schedule for the lectures is lab equipment: `minillm.lab.step_trace`.
"""
from .llm import LLM
from .llm_engine import LLMEngine, StepStats
from .outputs import CompletionOutput, RequestOutput
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["LLM", "LLMEngine", "StepStats", "RequestOutput", "CompletionOutput", "Request",
           "RequestStatus", "Scheduler", "SchedulerOutput"]
