"""The chapter 00 roofline exercise's grader is itself tested (the other chapter 00 exercises are
in test_grading.py): the solution passes, the stub fails, and planted bugs (every parameter
counted as a matmul weight, the output head or attention left out, attention not causal or with
KV heads, weights read once per sequence, the untied embedding read in full, the K/V writes left
out, a hard-coded 2 bytes per value, compute and memory times added, the bound reversed, ...)
are caught with a message that names the mistake. The grader's reference is minillm.roofline;
here its counts are also checked against a count of the real model's weights."""
import pytest
import torch

from minillm import configs, roofline
from minillm.grading import ch00, grade
from minillm.grading.testing import function_from_notebook
from minillm.kvmath import param_count
from minillm.loader import random_model

from grader_contract import ROOT, contract_tests, planted_bug_tests

NOTEBOOK = "00_foundations.ipynb"
LIMIT = 60
GRADED = {"roofline_step": ch00.ROOFLINE_STEP}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_roofline_exercise_is_listed_for_batch_grading():
    assert ch00.EXERCISES[-1] is ch00.ROOFLINE_STEP
    assert ch00.ROOFLINE_STEP.id == "ch00.roofline_step"


# ------------------------------------------------------------------ the reference itself

def test_matmul_weights_are_the_linear_layers_of_the_real_model():
    """minillm.roofline's matmul count equals the weights of every nn.Linear of a model built
    from the config (tiny shapes, untied and tied), and param_count equals all its parameters."""
    for tied in (False, True):
        cfg = configs.get("llama-3.2-1b").with_(
            name="tiny", num_layers=2, hidden_size=32, intermediate_size=48, num_heads=4,
            num_kv_heads=2, head_dim=8, vocab_size=96, tie_word_embeddings=tied)
        model = random_model(cfg, device="cpu", dtype=torch.float32)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert roofline.matmul_params(cfg) == linear                 # lm_head included, tied or not
        assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_bound_cases_straddle_the_ridge():
    """The bound check's two prefills sit on either side of the H100 ridge, one token apart."""
    below = ch00._Step("smollm2-135m", 1, 291, 0, 2, ch00._H100).expected
    above = ch00._Step("smollm2-135m", 1, 292, 0, 2, ch00._H100).expected
    assert (below["bound"], above["bound"]) == ("memory", "compute")


# ------------------------------------------------------------------ planted bugs

def _count(cfg, batch, num_tokens, context, bpv, bw, peak, *, weights_per="step",
           flops_params="matmul", head=True, attention="causal", attn_heads="query",
           embedding="gathered", kv_write=True, bytes_fixed=None, time="max", bound="right",
           validate=True):
    """A configurable roofline_step: the default is right; each keyword plants one mistake."""
    if validate and (batch < 1 or num_tokens < 1 or context < 0 or bw <= 0 or peak <= 0):
        raise ValueError("bad step")
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    layer = 2 * C * cfg.num_heads * D + 2 * C * cfg.num_kv_heads * D + 3 * C * cfg.intermediate_size
    out_head = cfg.vocab_size * C
    tokens = batch * num_tokens
    if flops_params == "all":
        flops = 2 * param_count(cfg) * tokens
    else:
        flops = 2 * (L * layer + (out_head if head else 0)) * tokens
    heads = cfg.num_heads if attn_heads == "query" else cfg.num_kv_heads
    if attention != "none":
        seen = (num_tokens * (context + num_tokens) if attention == "square"
                else num_tokens * context + num_tokens * (num_tokens + 1) // 2)
        flops += 4 * D * heads * L * batch * seen
    bpv = bytes_fixed or bpv
    weights = param_count(cfg) - (0 if cfg.tie_word_embeddings or embedding == "read" else out_head)
    weights *= batch if weights_per == "sequence" else 1
    kv_tokens = context + (num_tokens if kv_write else 0)
    nbytes = (weights + batch * kv_tokens * 2 * L * cfg.num_kv_heads * D) * bpv
    intensity = flops / nbytes
    t_compute, t_memory = flops / peak, nbytes / bw
    seconds = {"max": max, "min": min, "sum": lambda a, b: a + b}[time](t_compute, t_memory)
    memory = intensity < peak / bw
    if bound == "reversed":
        memory = not memory
    return {"flops": flops, "bytes": nbytes, "intensity": intensity, "seconds": seconds,
            "bound": "memory" if memory else "compute"}


def _bug(name, **kw):
    def fn(*args):
        return _count(*args, **kw)
    fn.__name__ = name
    return fn


def test_the_configurable_count_is_right_by_default():
    assert grade(ch00.ROOFLINE_STEP, _bug("right"), time_limit=LIMIT).full_marks


every_param = _bug("every_param", flops_params="all")
no_head = _bug("no_head", head=False)
no_attention = _bug("no_attention", attention="none")
square_attention = _bug("square_attention", attention="square")
attention_kv_heads = _bug("attention_kv_heads", attn_heads="kv")
weights_per_sequence = _bug("weights_per_sequence", weights_per="sequence")
reads_embedding = _bug("reads_embedding", embedding="read")
no_kv_write = _bug("no_kv_write", kv_write=False)
two_bytes = _bug("two_bytes", bytes_fixed=2)
adds_times = _bug("adds_times", time="sum")
faster_time = _bug("faster_time", time="min")
reversed_bound = _bug("reversed_bound", bound="reversed")
no_validation = _bug("no_validation", validate=False)


def intensity_upside_down(*args):
    out = _count(*args)
    out["intensity"] = out["bytes"] / out["flops"]
    return out


BUGS = [
    ("roofline_step", every_param, "decode FLOPs", "2 FLOPs for every parameter"),
    ("roofline_step", no_head, "decode FLOPs", "output head"),
    ("roofline_step", no_attention, "decode FLOPs", "attention's FLOPs are missing"),
    ("roofline_step", square_attention, "prefill FLOPs", "not causal"),
    ("roofline_step", attention_kv_heads, "decode FLOPs", "count num_heads"),
    ("roofline_step", weights_per_sequence, "not the weight reads", "once per sequence"),
    ("roofline_step", reads_embedding, "untied input embedding", "a lookup"),
    ("roofline_step", no_kv_write, "bytes: weights once per step", "K/V writes"),
    ("roofline_step", two_bytes, "bytes_per_value", "use bytes_per_value"),
    ("roofline_step", adds_times, "the slower of compute and memory time", "added compute time"),
    ("roofline_step", faster_time, "the slower of compute and memory time", "faster of the two"),
    ("roofline_step", intensity_upside_down, "intensity and seconds", "bytes / FLOPs"),
    ("roofline_step", reversed_bound, "bound:", "left of the ridge waits on memory"),
    ("roofline_step", no_validation, "bad input raises ValueError", "instead of raising"),
]

(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


@pytest.mark.parametrize("bug", [every_param, no_head, square_attention, weights_per_sequence,
                                 no_kv_write, two_bytes, adds_times, reversed_bound])
def test_a_bug_is_also_caught_by_the_random_check(bug):
    result = grade(ch00.ROOFLINE_STEP, bug, time_limit=LIMIT)
    assert any("random" in f for f in result.failed), str(result)


def test_a_float_count_and_tensor_numbers_are_accepted():
    sol = function_from_notebook(ROOT / "solutions" / NOTEBOOK, "roofline_step")

    def floats(*args):
        out = sol(*args)
        return {**out, "flops": float(out["flops"]), "bytes": torch.tensor(float(out["bytes"]),
                                                                           dtype=torch.float64)}
    assert grade(ch00.ROOFLINE_STEP, floats, time_limit=LIMIT).full_marks
