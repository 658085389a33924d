"""Chapter 12 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: memory and compute added
instead of maxed, the overhead left out, bytes counted in bf16 whatever the dtype, weights read
once per sequence; fused parts in reverse order, biases dropped, mixed biases accepted, the
checkpoint changed in place."""
import torch

from minillm.grading import ch12
from minillm.roofline import bytes_moved, forward_flops, weight_read_params
from minillm.kvmath import dtype_bytes

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "12_engine_overheads.ipynb"
GRADED = {"predict_step": ch12.PREDICT_STEP, "fuse_projections": ch12.FUSE_PROJECTIONS}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert [e.id for e in ch12.EXERCISES] == ["ch12.predict_step", "ch12.fuse_projections"]


def test_reference_limits_cover_all_three_terms():
    from minillm import configs
    cfg = configs.get("smollm2-135m")
    limits = {ch12.reference_predict_step(cfg, b, 64, "float32", bw, fl, n, s)["limit"]
              for b, bw, fl, n, s in ((1, 33e9, 183e9, 100, 1e-6), (512, 33e9, 183e9, 100, 1e-6),
                                      (1, 3.35e12, 989e12, 500, 5e-6))}
    assert limits == {"memory", "compute", "overhead"}


def test_reference_fuse_matches_the_parts_and_the_loader():
    import torch.nn.functional as F

    names = ["q_proj", "k_proj", "v_proj"]
    sd = ch12._checkpoint([64, 32, 32], names, bias=True, seed=1)
    weight, bias = ch12.reference_fuse_projections(sd, names)
    x = torch.randn(4, 64)
    assert torch.allclose(F.linear(x, weight, bias),
                          torch.cat([F.linear(x, sd[n + ".weight"], sd[n + ".bias"])
                                     for n in names], -1), atol=1e-5)


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
    def fuse_projections(state_dict, parts):
        if not parts or any(f"{p}.weight" not in state_dict for p in parts):
            raise ValueError("bad")
        ws = [state_dict[f"{p}.weight"] for p in parts]
        if any(w.shape[1] != ws[0].shape[1] for w in ws):
            raise ValueError("bad")
        has = [f"{p}.bias" in state_dict for p in parts]
        if not accept_mixed and len(set(has)) > 1:
            raise ValueError("bias")
        order = parts[::-1] if reverse else parts
        if in_place:
            state_dict[f"{parts[0]}.weight"].mul_(2.0)
        weight = torch.cat([state_dict[f"{p}.weight"] for p in order])
        bias = None
        if any(has) and not drop_bias:
            bias = torch.cat([state_dict.get(f"{p}.bias", torch.zeros(len(state_dict[
                f"{p}.weight"]))) for p in order])
        return weight, bias
    return fuse_projections


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
    ("fuse_projections", fuse_reversed, "GQA layer", "reverse order"),
    ("fuse_projections", fuse_no_bias, "biases travel", "biases are missing"),
    ("fuse_projections", fuse_mixed, "bad input", "q_proj with a bias"),
    ("fuse_projections", fuse_in_place, "left unchanged", "was changed"),
]
(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)
