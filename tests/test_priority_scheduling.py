"""scheduling_policy="priority" (vLLM's name): lower `priority` is admitted first, FCFS breaks
ties, the preemption victim is the lowest-priority request, and the default FCFS engine refuses a
priority rather than silently ignoring it."""
import pytest
from test_engine_modes import tiny_model

import minillm
from minillm import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def first_scheduled(llm, prompts, priorities, max_tokens=3):
    for i, (p, prio) in enumerate(zip(prompts, priorities)):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                               priority=prio)
    order, outs = [], {}
    while llm.engine.has_unfinished():
        for r in llm.engine.scheduler.running:
            if r.request_id not in order:
                order.append(r.request_id)
        for o in llm.engine.step():
            outs[o.request_id] = o
    return order, outs


def test_lower_priority_value_runs_first_and_ties_are_fcfs(model):
    llm = minillm.LLM((model, None), num_kv_blocks=64, block_size=4, max_num_seqs=1,
                      max_num_batched_tokens=64, scheduling_policy="priority")
    prompts = [list(range(10 + i, 20 + i)) for i in range(5)]
    order, _ = first_scheduled(llm, prompts, [5, 1, 5, 0, 1])
    assert order == ["3", "1", "4", "0", "2"]
    fcfs = minillm.LLM((model, None), num_kv_blocks=64, block_size=4, max_num_seqs=1,
                       max_num_batched_tokens=64)
    assert first_scheduled(fcfs, prompts, [0] * 5)[0] == ["0", "1", "2", "3", "4"]


def test_preemption_takes_the_lowest_priority_request_and_outputs_do_not_change(model):
    prompts = [list(range(30 + 7 * i, 42 + 7 * i)) for i in range(3)]
    ref = minillm.LLM((model, None), num_kv_blocks=64, block_size=4).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    llm = minillm.LLM((model, None), num_kv_blocks=12, block_size=4, max_num_batched_tokens=64,
                      scheduling_policy="priority")
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def watching():
        out = schedule()
        preempted.extend(r.request_id for r in out.preempted)
        return out
    llm.engine.scheduler.schedule = watching
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                        use_tqdm=False, priority=[2, 0, 1])
    assert preempted and set(preempted) <= {"0", "2"}       # never the priority-0 request
    assert preempted[0] == "0"                              # the lowest priority goes first
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_priority_needs_the_priority_policy_and_bad_values_are_refused(model):
    llm = minillm.LLM((model, None), num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), priority=1)
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        minillm.LLM((model, None), num_kv_blocks=16, block_size=4, scheduling_policy="sjf")
    prio = minillm.LLM((model, None), num_kv_blocks=16, block_size=4,
                       scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be an int"):
        prio.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), priority=0.5)
    with pytest.raises(ValueError, match="one per prompt"):
        prio.generate([[1, 2, 3]], SamplingParams(max_tokens=1), priority=[0, 1])
