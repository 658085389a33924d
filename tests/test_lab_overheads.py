"""lab/profiling.py and lab/overlap.py (chapter 12): structure only, no timing asserted."""
import pytest
import torch

from minillm.configs import ModelConfig
from minillm.lab import overlap
from minillm.lab.profiling import (GEMM_OPS, decode_engine, gemm_calls, op_table, profile_steps,
                                   skeleton_config, step_parts, time_outside_gemms)
from minillm.loader import random_model

CFG = ModelConfig(name="tiny", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)


def test_decode_engine_leaves_every_request_decoding():
    engine = decode_engine(random_model(CFG, device="cpu"), batch=3, context=20,
                           max_new_tokens=50)
    reqs = [r for rs in engine.groups.values() for r in rs]
    assert len(reqs) == 3 and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)


@pytest.mark.parametrize("batch", [2, 5])      # 2 rows: a tuned skinny product; 5: the packed
def test_profile_counts_four_products_per_layer_and_the_lm_head(batch):
    engine = decode_engine(random_model(CFG, device="cpu"), batch=batch, context=20,
                           max_new_tokens=50)
    prof = profile_steps(engine, steps=3, warmup=1)
    calls = {name: c for name, c, _ in prof.rows}
    assert sum(calls.get(op, 0) for op in GEMM_OPS) == 4 * CFG.num_layers + 1
    assert prof.ops_per_step > 4 * CFG.num_layers and prof.gemm_ms > 0
    assert "torch ops per step" in op_table(prof)


@pytest.mark.parametrize("batch", [1, 2, 5])   # skinny swap / tuned / packed products
def test_gemm_calls_clocks_every_product_and_puts_the_calls_back(batch):
    engine = decode_engine(random_model(CFG, device="cpu"), batch=batch, context=20,
                           max_new_tokens=50)
    saved = torch.mm, torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise
    with gemm_calls() as g:
        engine.step()
    assert g.calls == 4 * CFG.num_layers + 1 and g.seconds > 0
    assert (torch.mm, torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise) == saved
    step_ms, outside_ms = time_outside_gemms(engine, steps=3)
    assert 0 < outside_ms < step_ms


def test_step_parts_counts_every_step_and_puts_the_methods_back():
    engine = decode_engine(random_model(CFG, device="cpu"), batch=2, context=20,
                           max_new_tokens=50)
    runner = engine.runner
    with step_parts(engine) as parts:
        for _ in range(4):
            engine.step()
    ms = parts.ms_per_step()
    assert parts.steps == 4 and parts.calls["forward"] == 4 and parts.calls["propose"] == 4
    assert 0 < ms["forward"] < ms["step"] and ms["propose"] >= 0
    assert abs(ms["step"] - ms["forward"] - ms["propose"] - ms["other"]) < 1e-9
    assert "step_outputs" not in vars(engine) and "_propose" not in vars(engine)
    assert "_forward" not in vars(runner)                        # the classes' methods again
    engine.step()
    assert parts.steps == 4                                      # no longer counting


def test_the_skeleton_runs_the_same_ops_with_next_to_no_arithmetic():
    big = ModelConfig(name="wide", vocab_size=3000, hidden_size=256, intermediate_size=768,
                      num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=True)
    skel = skeleton_config(big)
    assert (skel.num_layers, skel.num_heads, skel.num_kv_heads, skel.tie_word_embeddings) == (
        big.num_layers, big.num_heads, big.num_kv_heads, big.tie_word_embeddings)
    assert skel.hidden_size * skel.intermediate_size < big.hidden_size * big.intermediate_size
    ops = []
    for cfg in (big, skel):
        engine = decode_engine(random_model(cfg, device="cpu"), batch=2, context=20,
                               max_new_tokens=50)
        ops.append(profile_steps(engine, steps=3, warmup=1).ops_per_step)
    # the same code path; a kernel may allocate a scratch tensor at one size and not another
    assert abs(ops[0] - ops[1]) <= 0.01 * ops[0]


def test_same_products_gives_the_skeleton_the_real_models_few_row_choices():
    from minillm.lab.profiling import same_products
    from minillm.model import Linear
    big = ModelConfig(name="wide", vocab_size=3000, hidden_size=256, intermediate_size=768,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      max_position_embeddings=256, tie_word_embeddings=False)
    real, skel = random_model(big, device="cpu"), random_model(skeleton_config(big), device="cpu")
    names = [n for n, m in real.named_modules() if isinstance(m, Linear)]
    for i, n in enumerate(names):                            # a different choice per layer
        real.get_submodule(n).skinny = ("swap", "linear", "packed")[i % 3]
        real.get_submodule(n).few = ("linear", "packed")[i % 2]
    same_products(skel, real)
    assert [(skel.get_submodule(n).skinny, skel.get_submodule(n).few) for n in names] == [
        (real.get_submodule(n).skinny, real.get_submodule(n).few) for n in names]


def test_overlap_runs_the_same_work_in_both_schedules():
    seen = []

    def prepare(i):
        seen.append(i)
        return torch.full((4,), float(i))

    serial, overlapped, same = overlap.compare(prepare, lambda x: x * 2, steps=5, rounds=2)
    assert same and serial > 0 and overlapped > 0
    assert sorted(seen) == sorted(list(range(5)) * 4)     # every step prepared once per run
    _, outs = overlap.run_overlapped(prepare, lambda x: x * 2, 4)
    assert [int(o[0]) for o in outs] == [0, 2, 4, 6]      # in step order
