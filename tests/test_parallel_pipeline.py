"""Pipeline parallelism (chapter 10): stages as threads with gloo send / recv, checked against
the full model; the bubble arithmetic checked on the ideal schedule. No timing assertions:
the measured bubble is recorded by benchmarks/bench_parallel.py."""
import pytest
import torch
from test_engine_modes import tiny_model

from minillm.parallel.pipeline import (bubble_fraction, gpipe_timeline, pipeline_forward,
                                       stage_layers)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stage_layers_are_contiguous_and_cover_the_model():
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="between 1 and the 2 layers"):
        stage_layers(2, 3)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_ideal_schedule_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    assert bubble_fraction(gpipe_timeline(pp, m), pp) == pytest.approx((pp - 1) / (m + pp - 1))


def test_a_stage_that_waits_shows_up_in_the_bubble():
    spans = gpipe_timeline(2, 4)
    slow = [s if s.stage == 0 else type(s)(s.stage, s.micro_batch, s.start + 1, s.end + 1)
            for s in spans]
    assert bubble_fraction(slow, 2) > bubble_fraction(spans, 2)


def test_pipeline_forward_equals_the_full_model():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, model.config.vocab_size, (1, t), generator=g) for t in (5, 9, 3)]
    logits, spans, stats = pipeline_forward(model, micro, pp=2)
    with torch.inference_mode():
        for ids, got in zip(micro, logits):
            torch.testing.assert_close(got, model(ids), rtol=1e-5, atol=1e-5)
    assert [(s.stage, s.micro_batch) for s in spans] == [(s, i) for s in range(2)
                                                         for i in range(3)]
    # one hidden-state tensor [1, T, C] crosses the boundary per micro-batch, fp32
    C = model.config.hidden_size
    assert stats[0].send_bytes == stats[1].recv_bytes == sum(4 * C * m.shape[1] for m in micro)
    assert 0.0 <= bubble_fraction(spans, 2) < 1.0
