"""The chapter-11 multi-tenant trace and its ideal hit rate, checked against the engine itself:
served one request at a time from one cache that is big enough never to evict, the engine's own
prompt-token hits must equal `ideal_hit_rate` exactly."""
import pytest

from minillm import LLM, SamplingParams
from minillm.lab.tenants import ideal_hit_rate, multi_tenant_trace
from tests.tiny import tiny_model


def test_trace_is_seeded_and_sessions_extend_their_turns():
    a = multi_tenant_trace(num_tenants=3, num_sessions=6, turns=3, seed=1)
    assert a == multi_tenant_trace(num_tenants=3, num_sessions=6, turns=3, seed=1)
    assert a != multi_tenant_trace(num_tenants=3, num_sessions=6, turns=3, seed=2)
    assert [r.arrival_time for r in a] == sorted(r.arrival_time for r in a)
    by_session = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt_ids[:len(earlier.prompt_ids)] == earlier.prompt_ids
    with pytest.raises(ValueError):
        multi_tenant_trace(num_sessions=0)


@pytest.mark.parametrize("user_len", [32, 21])       # block-aligned prompts and ragged ones
def test_ideal_hit_rate_is_what_one_unbounded_engine_reaches(user_len):
    trace = multi_tenant_trace(num_tenants=2, num_sessions=4, turns=3, system_len=32,
                               user_len=user_len, answer_len=user_len, vocab_size=1000, seed=3)
    llm = LLM(tiny_model(max_position_embeddings=512), enable_prefix_caching=True,
              num_kv_blocks=256, block_size=16)
    hit = total = 0
    for r in trace:                                   # one at a time, in arrival order
        out = llm.generate([list(r.prompt_ids)], SamplingParams(max_tokens=2))[0]
        hit += out.num_cached_tokens
        total += len(r.prompt_ids)
    assert hit > 0
    assert hit / total == pytest.approx(ideal_hit_rate(trace, block_size=16))
