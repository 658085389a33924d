"""Chapter 09 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: floor instead of round, a
scale from max instead of max - min, swapped nibbles, an interleaved or d/m-swapped Q4_1 block,
a forgotten minimum, bits counted as bytes, metadata forgotten, an inverted speedup."""
import numpy as np
import torch

from minillm.grading import ch09, grade

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "09_quantization.ipynb"
GRADED = {
    "quantize_int4": ch09.QUANT,
    "decode_q4_1": ch09.DECODE,
    "deployment_estimate": ch09.ESTIMATE,
}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert [e.id for e in ch09.EXERCISES] == ["ch09.quantize_int4", "ch09.decode_q4_1",
                                             "ch09.deployment_estimate"]


# ------------------------------------------------------------------ planted bugs
def _quant(rounding=torch.round, scale_from_max=False, swap_nibbles=False):
    def quantize_int4(w, group_size):
        N, K = w.shape
        if K % group_size:
            raise ValueError("group size")
        g = w.float().reshape(N, K // group_size, group_size)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi if scale_from_max else hi - lo) / 15).clamp(min=1e-8)
        zero = torch.clamp(torch.round(-lo / scale), 0, 15)
        code = torch.clamp(rounding(g / scale[..., None]) + zero[..., None], 0, 15)
        code = code.reshape(N, K).to(torch.uint8)
        a, b = (code[:, 1::2], code[:, 0::2]) if swap_nibbles else (code[:, 0::2], code[:, 1::2])
        return a | (b << 4), scale, zero
    return quantize_int4


quant_floor = _quant(rounding=torch.floor)
quant_floor.__name__ = "quant_floor"
quant_scale_from_max = _quant(scale_from_max=True)
quant_scale_from_max.__name__ = "quant_scale_from_max"
quant_swapped_nibbles = _quant(swap_nibbles=True)
quant_swapped_nibbles.__name__ = "quant_swapped_nibbles"


def _decode(interleaved=False, swap_dm=False, no_min=False):
    def decode_q4_1(raw, shape):
        blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        if swap_dm:
            d, m = m, d
        qs = blocks[:, 4:]
        if interleaved:
            codes = np.stack((qs & 15, qs >> 4), axis=-1).reshape(len(qs), 32)
        else:
            codes = np.concatenate((qs & 15, qs >> 4), axis=1)
        return torch.from_numpy(d * codes + (0 if no_min else m)).reshape(shape).float()
    return decode_q4_1


decode_interleaved = _decode(interleaved=True)
decode_interleaved.__name__ = "decode_interleaved"
decode_swapped_dm = _decode(swap_dm=True)
decode_swapped_dm.__name__ = "decode_swapped_dm"
decode_no_min = _decode(no_min=True)
decode_no_min.__name__ = "decode_no_min"


def _estimate(bits_not_bytes=False, no_metadata=False, inverted=False):
    def deployment_estimate(num_params, bits, group_size, bandwidth, baseline_bits=16,
                            scale_bytes=4):
        if bits not in (4, 8, 16) or (group_size is not None and group_size <= 0):
            raise ValueError("bad")
        per = bits if bits_not_bytes else bits / 8
        nbytes = num_params * per
        if group_size and not no_metadata:
            nbytes += num_params // group_size * scale_bytes
        base = num_params * baseline_bits / 8
        return {"weight_bytes": nbytes, "step_seconds": nbytes / bandwidth,
                "speedup": nbytes / base if inverted else base / nbytes}
    return deployment_estimate


est_bits = _estimate(bits_not_bytes=True)
est_bits.__name__ = "est_bits"
est_no_metadata = _estimate(no_metadata=True)
est_no_metadata.__name__ = "est_no_metadata"
est_inverted = _estimate(inverted=True)
est_inverted.__name__ = "est_inverted"

BUGS = [
    ("quantize_int4", quant_floor, "round to the nearest", "torch.round"),
    ("quantize_int4", quant_scale_from_max, "(max - min) / 15", "RANGE"),
    ("quantize_int4", quant_swapped_nibbles, "nibble order", "swapped"),
    ("decode_q4_1", decode_interleaved, "nibble order", "does not interleave"),
    ("decode_q4_1", decode_swapped_dm, "one block", "swapped"),
    ("decode_q4_1", decode_no_min, "one block", "minimum m is missing"),
    ("deployment_estimate", est_bits, "bf16 baseline", "divide by 8"),
    ("deployment_estimate", est_no_metadata, "metadata", "scales and zero points are missing"),
    ("deployment_estimate", est_inverted, "speedup =", "inverted"),
]
(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_a_decoder_that_raises_is_reported():
    def broken(raw, shape):
        raise IndexError("oops")
    result = grade(ch09.DECODE, broken, time_limit=30)
    assert result.score == 0 and "IndexError" in result.messages[0]


def test_the_graders_encoder_round_trips_through_minillm():
    from minillm.quant.gguf import decode_q4_1
    w = torch.randn(2, 64)
    step = (w.reshape(-1, 32).amax(1) - w.reshape(-1, 32).amin(1)) / 15
    err = (decode_q4_1(ch09.encode_q4_1(w), (2, 64)) - w).reshape(-1, 32).abs()
    assert (err <= step[:, None] * 0.51 + 1e-3).all()
