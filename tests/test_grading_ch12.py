"""Chapter 12 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: memory and compute added
instead of maxed, the overhead left out, bytes counted in bf16 whatever the dtype, weights read
once per sequence; fused parts in reverse order, biases dropped, mixed biases accepted, the
input layers changed in place."""
import torch

from minillm.grading import ch12
from minillm.roofline import bytes_moved, forward_flops, weight_read_params
from minillm.kvmath import dtype_bytes

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "12_engine_overheads.ipynb"
GRADED = {"predict_step": ch12.PREDICT_STEP, "fuse_linears": ch12.FUSE_LINEARS}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert [e.id for e in ch12.EXERCISES] == ["ch12.predict_step", "ch12.fuse_linears"]


def test_reference_limits_cover_all_three_terms():
    from minillm import configs
    cfg = configs.get("smollm2-135m")
    limits = {ch12.reference_predict_step(cfg, b, 64, "float32", bw, fl, n, s)["limit"]
              for b, bw, fl, n, s in ((1, 33e9, 183e9, 100, 1e-6), (512, 33e9, 183e9, 100, 1e-6),
                                      (1, 3.35e12, 989e12, 500, 5e-6))}
    assert limits == {"memory", "compute", "overhead"}


def test_reference_fuse_matches_the_parts():
    layers = ch12._layers([64, 32, 32], bias=True, seed=1)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.allclose(ch12.reference_fuse_linears(layers)(x),
                              torch.cat([lin(x) for lin in layers], -1), atol=1e-5)


# ------------------------------------------------------------------ planted bugs
def _predict(added=False, no_overhead=False, bf16_bytes=False, per_sequence=False):
    def predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops, op_seconds):
        if bandwidth <= 0 or flops <= 0 or num_ops < 0 or op_seconds < 0:
            raise ValueError("bad")
        nbytes = bytes_moved(cfg, batch, 1, context, "bfloat16" if bf16_bytes else dtype)
        if per_sequence:
            nbytes += (batch - 1) * weight_read_params(cfg) * dtype_bytes(dtype)
        memory, compute = nbytes / bandwidth, forward_flops(cfg, 1, context, batch) / flops
        overhead = 0.0 if no_overhead else num_ops * op_seconds
        step = memory + compute + overhead if added else max(memory, compute) + overhead
        terms = {"memory": memory, "compute": compute, "overhead": overhead}
        return {"memory_s": memory, "compute_s": compute, "overhead_s": overhead,
                "step_s": step, "limit": max(terms, key=terms.get)}
    return predict_step


predict_added = _predict(added=True)
predict_no_overhead = _predict(no_overhead=True)
predict_bf16_bytes = _predict(bf16_bytes=True)
predict_per_sequence = _predict(per_sequence=True)
for _f, _n in ((predict_added, "predict_added"), (predict_no_overhead, "predict_no_overhead"),
               (predict_bf16_bytes, "predict_bf16_bytes"),
               (predict_per_sequence, "predict_per_sequence")):
    _f.__name__ = _n


def _fuse(reverse=False, drop_bias=False, accept_mixed=False, in_place=False):
    def fuse_linears(linears):
        if not linears or any(lin.in_features != linears[0].in_features for lin in linears):
            raise ValueError("bad")
        if not accept_mixed and len({lin.bias is None for lin in linears}) > 1:
            raise ValueError("bias")
        parts = linears[::-1] if reverse else linears
        bias = linears[0].bias is not None and not drop_bias
        fused = torch.nn.Linear(linears[0].in_features, sum(lin.out_features for lin in parts),
                                bias=bias)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([lin.weight for lin in parts]))
            if bias:
                fused.bias.copy_(torch.cat([lin.bias if lin.bias is not None
                                            else torch.zeros(lin.out_features) for lin in parts]))
            if in_place:
                linears[0].weight.mul_(1.0)
                linears[0].weight.add_(1.0)
                linears[0].weight.sub_(1.0 - 1e-3)
        return fused
    return fuse_linears


fuse_reversed = _fuse(reverse=True)
fuse_no_bias = _fuse(drop_bias=True)
fuse_mixed = _fuse(accept_mixed=True)
fuse_in_place = _fuse(in_place=True)
for _f, _n in ((fuse_reversed, "fuse_reversed"), (fuse_no_bias, "fuse_no_bias"),
               (fuse_mixed, "fuse_mixed"), (fuse_in_place, "fuse_in_place")):
    _f.__name__ = _n

BUGS = [
    ("predict_step", predict_added, "step_s = max", "ADDED"),
    ("predict_step", predict_no_overhead, "overhead_s = num_ops", "per-op cost is missing"),
    ("predict_step", predict_bf16_bytes, "memory_s = bytes", "counted in bf16"),
    ("predict_step", predict_per_sequence, "memory_s = bytes", "once per sequence"),
    ("fuse_linears", fuse_reversed, "GQA layer", "reverse order"),
    ("fuse_linears", fuse_no_bias, "biases travel", "biases are missing"),
    ("fuse_linears", fuse_mixed, "bad input", "one layer with a bias and one without"),
    ("fuse_linears", fuse_in_place, "left unchanged", "was changed"),
]
(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)
