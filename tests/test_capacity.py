"""minillm.lab.capacity: the SLO-miss shares and the TPOT concurrency limit of lecture 08 s4."""
from types import SimpleNamespace as M

import pytest

from minillm.lab.capacity import max_concurrency_for_tpot, slo_miss_fractions
from minillm.lab.serving_replay import StepCost


def test_slo_miss_fractions_counts_each_objective_strictly_above_its_bound():
    ms = [M(ttft=0.1, tpot=0.05), M(ttft=0.5, tpot=0.2), M(ttft=0.3, tpot=None),
          M(ttft=0.2, tpot=0.1)]
    got = slo_miss_fractions(ms, ttft_slo=0.3, tpot_slo=0.1)
    assert got == {"ttft": 0.25, "tpot": 0.25}     # 0.3 and 0.1 exactly meet; None never misses
    with pytest.raises(ValueError):
        slo_miss_fractions([], 1.0, 1.0)


def test_max_concurrency_for_tpot_is_the_largest_n_whose_mean_step_fits():
    cost = StepCost(fixed=0.08, per_token=0.003, per_seq=0.001)
    prompt, out, slo = 19.0, 36.0, 0.15
    n = max_concurrency_for_tpot(cost, slo, prompt, out)

    def mean_step(k):                   # k requests, each adding (prompt + out - 1) / out tokens
        return cost(k * (prompt + out - 1) / out, k)
    assert mean_step(n) <= slo < mean_step(n + 1)
    assert max_concurrency_for_tpot(cost, 0.05, prompt, out) == 0      # below the fixed cost
    for bad in ((0.0, 19, 36), (0.1, 0, 36), (0.1, 19, 0)):
        with pytest.raises(ValueError):
            max_concurrency_for_tpot(cost, *bad)
