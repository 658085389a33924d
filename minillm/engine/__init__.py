"""The serving engine (chapters 04-07): requests, scheduler, model runner, LLMEngine, LLM.

One step is schedule -> execute -> update (see llm_engine.py). Later chapters enter through
seams that do nothing until they are turned on: prefix caching (chapter 06) is a flag of the
block manager, whose lookup finds nothing while it is off; speculative decoding (chapter 07) is
a proposer that proposes nothing while it is off.

    request.py       Request: prompt + outputs, num_computed_tokens chasing num_tokens, states,
                     drafts; everything the engine knows about one sequence
    scheduler.py     schedule(): FCFS, token budget, chunked prefill, static vs continuous,
                     preemption, n > 1 forks; update_from_output(): append, roll back, stop, free
    model_runner.py  execute(): block copies, one ragged forward, sampled / verified tokens
    spec_decode.py   the speculation seam: DraftRequest, Draft, NoProposer, build_proposer, verify
    llm_engine.py    add_request / step / step_outputs / has_unfinished / abort_request
    llm.py           LLM.generate(prompts, sampling_params): the offline batch API
    outputs.py       RequestOutput / CompletionOutput, and per-step TokenDelta / StepOutput

Recording or replaying a schedule for the lectures is lab equipment: `minillm.lab.step_trace`.
"""
from .llm import LLM
from .llm_engine import LLMEngine, StepStats
from .outputs import CompletionOutput, RequestOutput, StepOutput, TokenDelta
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["LLM", "LLMEngine", "StepStats", "RequestOutput", "CompletionOutput", "StepOutput",
           "TokenDelta", "Request", "RequestStatus", "Scheduler", "SchedulerOutput"]
