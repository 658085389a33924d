"""Chapter 05 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs (metadata without the leading 0 in cu_seqlens_q, off-by-one positions, seq_lens
without the context; a prefill kernel with the top-left causal mask of is_causal=True, blocks read
in pool order instead of through the table, the stale tail of the last block read, GQA heads
tiled, a hard-coded scale, ...) are caught with a message that names the mistake. The references
are checked against minillm's own model runner and against plain per-sequence attention."""
import functools
import math
from pathlib import Path

import pytest
import torch

from minillm.cache.blocks import BlockManager
from minillm.configs import get
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request
from minillm.grading import ch05, grade
from minillm.grading.testing import function_from_notebook

from grader_contract import contract_tests, planted_bug_tests
from minillm.loader import random_model
from minillm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "05_chunked_prefill.ipynb"
SOLUTIONS, EXERCISES = ROOT / "solutions" / NOTEBOOK, ROOT / "exercises" / NOTEBOOK
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

GRADED = {
    "step_metadata": ch05.STEP_METADATA,
    "paged_prefill_attention": ch05.PREFILL_ATTENTION,
}


# ------------------------------------------------------------------ solution passes, stub fails

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch05.EXERCISES == (ch05.STEP_METADATA, ch05.PREFILL_ATTENTION)
    assert [e.id for e in ch05.EXERCISES] == ["ch05.step_metadata", "ch05.prefill_attention"]


def test_a_learner_function_that_loops_forever_is_stopped():
    def spins(*args):
        while True:
            pass
    result = grade(ch05.PREFILL_ATTENTION, spins, time_limit=2)
    assert result.score == 0
    assert "time limit" in result.messages[0]


@functools.lru_cache(maxsize=1)
def _tiny_model():
    cfg = get("smollm2-135m").with_(name="tiny", num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=8, hidden_size=16, intermediate_size=32,
                                    vocab_size=64, max_position_embeddings=512)
    return random_model(cfg, device="cpu", dtype=torch.float32)


def _runner_metadata(spans):
    """What minillm's ModelRunner.prepare builds for these spans."""
    model = _tiny_model()
    num_blocks = sum(-(-(c + n) // 4) for c, n in spans)
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    runner = ModelRunner(model, bm, num_blocks=num_blocks, block_size=4)
    scheduled = []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i, (c, n) in enumerate(spans):
        req = Request(i, str(i), [1] * (c + n), params, 0.0, i)
        req.num_computed_tokens = c
        bm.allocate(i, c + n)
        req.kv = bm.kv(i)                        # what the scheduler hands the request
        scheduled.append((req, n))
    meta = runner.prepare(scheduled).meta
    return {"cu_seqlens_q": meta.cu_seqlens_q.tolist(), "positions": meta.positions.tolist(),
            "seq_lens": meta.seq_lens.tolist()}


def test_reference_metadata_is_what_the_model_runner_builds():
    cases = ch05._MIXED + ch05._random_spans(7, 200)[:40] + [[(7, 1), (0, 4), (12, 1)]]
    for spans in cases:
        assert ch05.reference_metadata(spans) == _runner_metadata(spans), spans
    assert ch05.reference_metadata([(7, 1), (0, 4), (12, 1)]) == {
        "cu_seqlens_q": [0, 1, 5, 6], "positions": [7, 0, 1, 2, 3, 12], "seq_lens": [8, 4, 13]}


# ------------------------------------------------------------------ planted bugs: step_metadata

def _spans_ok(spans):
    if any(c < 0 or n < 1 for c, n in spans):
        raise ValueError("bad span")


def meta_no_leading_zero(spans):
    _spans_ok(spans)
    cu, total = [], 0
    for _, n in spans:
        total += n
        cu.append(total)
    return {"cu_seqlens_q": cu, "positions": [p for c, n in spans for p in range(c, c + n)],
            "seq_lens": [c + n for c, n in spans]}


def meta_cu_sums_seq_lens(spans):
    _spans_ok(spans)
    cu = [0]
    for c, n in spans:
        cu.append(cu[-1] + c + n)
    return {"cu_seqlens_q": cu, "positions": [p for c, n in spans for p in range(c, c + n)],
            "seq_lens": [c + n for c, n in spans]}


def meta_positions_off_by_one(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["positions"] = [p for c, n in spans for p in range(c + 1, c + n + 1)]
    return out


def meta_positions_restart(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["positions"] = [p for _, n in spans for p in range(n)]
    return out


def meta_seq_lens_new_only(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["seq_lens"] = [n for _, n in spans]
    return out


def meta_seq_lens_context_only(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["seq_lens"] = [c for c, _ in spans]
    return out


def meta_trusts_the_caller(spans):
    cu, positions, seq_lens = [0], [], []                     # right rules, no checks at all
    for c, n in spans:
        positions += range(c, c + n)
        seq_lens.append(c + n)
        cu.append(cu[-1] + n)
    return {"cu_seqlens_q": cu, "positions": positions, "seq_lens": seq_lens}


def meta_as_tensors_but_float(spans):
    _spans_ok(spans)
    out = ch05.reference_metadata(spans)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}


# ------------------------------------------------------------------ planted bugs: prefill attention

def _prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, *,
             mask="causal", table="paged", tail="cut", heads="grouped", scale_from="argument",
             context="read", dtype_out="q"):
    """A configurable paged prefill: the default is right; each keyword plants one mistake."""
    out = torch.empty(q.shape, dtype=torch.float32)
    bs = k_cache.shape[1]
    KVH = k_cache.shape[2]
    H, D = q.shape[1], q.shape[2]
    for b in range(len(seq_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seq_len, q_len = int(seq_lens[b]), end - start
        length = -(-seq_len // bs) * bs if tail == "whole_blocks" else seq_len
        if table == "pool_order":
            k = k_cache.flatten(0, 1)[:length]
            v = v_cache.flatten(0, 1)[:length]
        else:
            blocks = block_tables[b, :-(-length // bs)].long()
            k = k_cache[blocks].flatten(0, 1)[:length]
            v = v_cache[blocks].flatten(0, 1)[:length]
        first = seq_len - q_len if context == "dropped" else 0
        k, v = k[first:], v[first:]
        idx = torch.arange(H) % KVH if heads == "tiled" else torch.arange(H) // (H // KVH)
        k, v = k[:, idx].float(), v[:, idx].float()                   # [Tk, H, D]
        s = 1 / math.sqrt(D) if scale_from == "head_dim" else scale
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * s
        q_pos = torch.arange(length - q_len, length)[:, None]     # padded: the slots, not seq_len
        if mask == "top_left":
            q_pos = torch.arange(q_len)[:, None]
        k_pos = torch.arange(first, first + k.shape[0])[None, :]
        if mask == "hides_self":
            scores = scores.masked_fill(k_pos >= q_pos, float("-inf"))
        elif mask != "none":
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out if dtype_out == "float32" else out.to(q.dtype)


def prefill_is_causal_true(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """The trap: scaled_dot_product_attention(is_causal=True) on a chunk with context."""
    out = torch.empty_like(q)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b in range(len(seq_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seq_len = int(seq_lens[b])
        blocks = block_tables[b, :-(-seq_len // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def prefill_no_mask(*a):
    return _prefill(*a, mask="none")


def prefill_hides_self(*a):
    return _prefill(*a, mask="hides_self")


def prefill_in_pool_order(*a):
    return _prefill(*a, table="pool_order")


def prefill_reads_whole_last_block(*a):
    """Gathers whole blocks and takes the last q_len keys as the queries' own positions."""
    return _prefill(*a, tail="whole_blocks")


def prefill_tiles_heads(*a):
    return _prefill(*a, heads="tiled")


def prefill_hard_codes_scale(*a):
    return _prefill(*a, scale_from="head_dim")


def prefill_drops_context(*a):
    return _prefill(*a, context="dropped")


def prefill_returns_float32(*a):
    return _prefill(*a, dtype_out="float32")


def prefill_scales_in_place(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    q.mul_(scale)                                    # saves a multiply, clobbers the caller's q
    return _prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, 1.0)


# exercise, bug, a check it must fail, words that check's message must contain
BUGS = [
    ("step_metadata", meta_no_leading_zero, "starts at 0", "leading 0 is missing"),
    ("step_metadata", meta_no_leading_zero, "an empty step", "cu_seqlens_q is [], expected [0]"),
    ("step_metadata", meta_cu_sums_seq_lens, "running sum", "you summed seq_lens"),
    ("step_metadata", meta_positions_off_by_one, "positions continue", "off by one"),
    ("step_metadata", meta_positions_restart, "positions continue", "restart at 0"),
    ("step_metadata", meta_seq_lens_new_only, "seq_lens count", "only the new tokens"),
    ("step_metadata", meta_seq_lens_context_only, "seq_lens count", "only the cached tokens"),
    ("step_metadata", meta_trusts_the_caller, "bad span raises ValueError", "instead of raising"),
    ("step_metadata", meta_as_tensors_but_float, "starts at 0", "dtype torch.float32"),
    ("paged_prefill_attention", prefill_is_causal_true, "a later chunk", "aligned to the top left"),
    ("paged_prefill_attention", prefill_is_causal_true, "a decode",
     "instead of seq_len - q_len + i"),
    ("paged_prefill_attention", prefill_no_mask, "a whole prompt", "no causal mask"),
    ("paged_prefill_attention", prefill_hides_self, "a whole prompt", "sees at least its own key"),
    ("paged_prefill_attention", prefill_hides_self, "a later chunk", "cannot see its own key"),
    ("paged_prefill_attention", prefill_in_pool_order, "through the block table",
     "instead of through the block table"),
    ("paged_prefill_attention", prefill_reads_whole_last_block, "partly filled last block",
     "cut the gathered keys at seq_len"),
    ("paged_prefill_attention", prefill_tiles_heads, "GQA", "h % KVH"),
    ("paged_prefill_attention", prefill_hard_codes_scale, "scale argument", "1/sqrt(head_dim)"),
    ("paged_prefill_attention", prefill_drops_context, "a later chunk", "this step's own keys"),
    ("paged_prefill_attention", prefill_returns_float32, "bfloat16 in", "return q's dtype"),
    ("paged_prefill_attention", prefill_scales_in_place, "inputs untouched", "modified its inputs"),
]


(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


@pytest.mark.parametrize("name, bug", [
    ("step_metadata", meta_no_leading_zero), ("step_metadata", meta_positions_off_by_one),
    ("step_metadata", meta_seq_lens_new_only),
    ("paged_prefill_attention", prefill_is_causal_true),
    ("paged_prefill_attention", prefill_in_pool_order),
    ("paged_prefill_attention", prefill_reads_whole_last_block),
    ("paged_prefill_attention", prefill_tiles_heads),
    ("paged_prefill_attention", prefill_hard_codes_scale)])
def test_a_bug_is_also_caught_by_the_random_check(name, bug):
    result = grade(GRADED[name], bug, time_limit=LIMIT)
    assert any("random" in f for f in result.failed), str(result)


def test_metadata_grader_accepts_int_tensors():
    meta = function_from_notebook(SOLUTIONS, "step_metadata")

    def as_tensors(spans):
        return {k: torch.tensor(v, dtype=torch.int32) for k, v in meta(spans).items()}
    assert grade(ch05.STEP_METADATA, as_tensors, time_limit=LIMIT).full_marks


def test_prefill_grader_accepts_a_bfloat16_computation():
    """Computing in the input dtype (no float32 upcast) is a legitimate kernel choice."""
    def native(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        out = torch.empty_like(q)
        bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
        for b in range(len(seq_lens)):
            start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            seq_len, q_len = int(seq_lens[b]), end - start
            blocks = block_tables[b, :-(-seq_len // bs)].long()
            k = k_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            v = v_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            visible = torch.arange(seq_len)[None, :] <= query_pos
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=visible, scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out
    assert grade(ch05.PREFILL_ATTENTION, native, time_limit=LIMIT).full_marks


# ------------------------------------------------------------------ the prefill reference itself

@pytest.mark.parametrize("spec", ch05._random_steps(17, 30)[:10], ids=lambda s: s["label"])
def test_prefill_reference_is_causal_attention_per_sequence(spec):
    """The grader's answer key (minillm's kernel twin) against scaled_dot_product_attention on
    each sequence's own keys, gathered from the K/V the case generated (not from the pool)."""
    step = ch05._Step(**spec)
    row = 0
    for (c, n), k, v in zip(step.spans, step.keys, step.values):
        group = step.H // step.KVH
        qb = step.q[row:row + n].transpose(0, 1)                              # [H, n, D]
        kb = k.repeat_interleave(group, dim=1).transpose(0, 1)                # [H, c + n, D]
        vb = v.repeat_interleave(group, dim=1).transpose(0, 1)
        visible = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible,
                                                                scale=step.scale)
        assert torch.allclose(step.expected[row:row + n], want.transpose(0, 1), atol=1e-5)
        row += n
    assert row == step.q.shape[0]


def test_prefill_cases_put_stale_values_where_a_mistake_would_read_them():
    step = ch05._Step("partial", [(5, 2)], scatter=False)
    # 7 tokens in blocks of 4: slot 3 of block 1 is stale, and far from the stored keys
    assert step.block_tables.tolist() == [[0, 1, 0]]
    assert torch.equal(step.k_cache[1, 2], step.keys[0][6])          # the last stored key
    assert step.k_cache[1, 3].mean() > 1 > step.keys[0].mean()       # stale: shifted by +2


def test_every_prefill_diagnosis_is_reachable():
    """Each named mistake differs from the right answer on some check case (else its sentence
    could never be shown, or worse, be shown for a right answer)."""
    step = ch05._Step("mixed", [(5, 1), (0, 6), (9, 3)], H=4, KVH=2, block_size=4, scale=0.3,
                      seed=3)
    for variant, sentence in ch05._PREFILL_DIAGNOSES:
        assert not torch.allclose(ch05._attend_variant(step, **variant), step.expected,
                                  atol=1e-3), sentence
    assert torch.allclose(ch05._attend_variant(step), step.expected, atol=1e-5)
