"""The graders are themselves tested: the solution passes, the stub fails, planted bugs are caught,
and learner code that raises, loops or crashes is reported instead of breaking the grader."""
import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F

from minillm.grading import (Check, Exercise, LearnerError, TimeLimitExceeded, ch00, ch01, grade,
                             parse_grade_lines, run_with_time_limit)
from minillm.grading.batch import grade_folder, grade_submission, problem_sets
from minillm.grading.testing import function_from_notebook, function_source

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

# exercise, problem-set notebook, function the learner writes
GRADED = {
    "cached_attention": (ch00.CACHED_ATTENTION, "00_foundations.ipynb"),
    "top_p_filter": (ch00.TOP_P, "00_foundations.ipynb"),
    "top_k_filter": (ch00.TOP_K, "00_foundations.ipynb"),
    "kv_bytes_per_token": (ch01.KV_BYTES, "01_kv_cache_math.ipynb"),
    "max_concurrent_seqs": (ch01.MAX_CONCURRENCY, "01_kv_cache_math.ipynb"),
}


def solution(name):
    return function_from_notebook(SOLUTIONS / GRADED[name][1], name)


def stub(name):
    return function_from_notebook(EXERCISES / GRADED[name][1], name)


# ------------------------------------------------------------------ solution passes, stub fails

@pytest.mark.parametrize("name", GRADED)
def test_solution_scores_full_marks(name):
    result = grade(GRADED[name][0], solution(name), time_limit=LIMIT)
    assert result.full_marks, str(result)
    assert result.max >= 5


@pytest.mark.parametrize("name", GRADED)
def test_unfilled_exercise_fails_every_check(name):
    result = grade(GRADED[name][0], stub(name), time_limit=LIMIT)
    assert result.score == 0, str(result)
    assert all("not written yet" in m for m in result.messages), result.messages


def test_solution_cells_hold_the_marked_solution():
    # the functions above come from the notebooks' real text, markers included
    for name, (_, notebook) in GRADED.items():
        src = function_source(SOLUTIONS / notebook, name)
        assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
        assert "### BEGIN SOLUTION" not in function_source(EXERCISES / notebook, name)


# ------------------------------------------------------------------ planted bugs: attention

def _attention(q, k_all, v_all, start, mask="causal", heads="grouped"):
    """Shared body of the buggy attention variants below."""
    B, T, H, D = q.shape
    group = H // k_all.shape[2]
    if heads == "tiled":
        k_all, v_all = k_all.repeat(1, 1, group, 1), v_all.repeat(1, 1, group, 1)
    else:
        k_all, v_all = (k_all.repeat_interleave(group, dim=2),
                        v_all.repeat_interleave(group, dim=2))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_all) / math.sqrt(D)
    q_pos = torch.arange(start, start + T)[:, None]
    if mask == "ignores_start":
        q_pos = q_pos - start
    k_pos = torch.arange(k_all.shape[1])[None, :]
    hide = k_pos >= q_pos if mask == "hides_self" else k_pos > q_pos
    scores = scores.masked_fill(hide, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v_all)


def attn_mask_off_by_one(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    return _attention(q, k_cache[:, :end], v_cache[:, :end], start, mask="hides_self")


def attn_ignores_start(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    return _attention(q, k_cache[:, :end], v_cache[:, :end], start, mask="ignores_start")


def attn_gqa_tiled(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    return _attention(q, k_cache[:, :end], v_cache[:, :end], start, heads="tiled")


def attn_sdpa_is_causal(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    group = q.shape[2] // k.shape[2]
    keys = k_cache[:, :end].repeat_interleave(group, dim=2).transpose(1, 2)    # [B, H, end, D]
    values = v_cache[:, :end].repeat_interleave(group, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True)
    return out.transpose(1, 2)


def attn_does_not_write(q, k, v, k_cache, v_cache, start):
    keys = torch.cat([k_cache[:, :start], k], dim=1)
    values = torch.cat([v_cache[:, :start], v], dim=1)
    return _attention(q, keys, values, start)


def attn_writes_one_late(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start + 1:end + 1], v_cache[:, start + 1:end + 1] = k, v
    return _attention(q, k_cache[:, :end], v_cache[:, :end], start)


def attn_reads_whole_slab(q, k, v, k_cache, v_cache, start):
    end = start + q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    if q.shape[1] == 1:                       # "a single query needs no mask"
        group = q.shape[2] // k.shape[2]
        keys = k_cache.repeat_interleave(group, dim=2)
        values = v_cache.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / math.sqrt(q.shape[-1])
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values)
    return _attention(q, k_cache[:, :end], v_cache[:, :end], start)


# ------------------------------------------------------------------ planted bugs: top-p, top-k

def top_p_drops_crossing_token(logits, p):
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    drop_sorted = probs.cumsum(-1) > p                   # also drops the token that reaches p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted),
                              float("-inf"))


def top_p_one_too_many(logits, p):
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    before = probs.cumsum(-1) - probs
    drop_sorted = torch.zeros_like(before, dtype=torch.bool)
    drop_sorted[:, 1:] = before[:, :-1] >= p             # shifted once too often
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted),
                              float("-inf"))


def top_p_forgets_to_unsort(logits, p):
    probs, _ = logits.softmax(-1).sort(-1, descending=True)
    drop_sorted = probs.cumsum(-1) - probs >= p
    return logits.masked_fill(drop_sorted, float("-inf"))  # sorted positions used as token ids


def top_p_returns_probs(logits, p):
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    drop_sorted = probs.cumsum(-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.softmax(-1).masked_fill(drop, 0.0)


def top_p_flattens_batch(logits, p):
    # one sort over the whole batch: the rows compete with each other
    probs = (logits.softmax(-1) / logits.shape[0]).reshape(1, -1)
    probs, order = probs.sort(-1, descending=True)
    drop_sorted = probs.cumsum(-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted).reshape(logits.shape)
    return logits.masked_fill(drop, float("-inf"))


def top_k_keeps_one_extra(logits, k):
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_no_special_cases(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # raises for k = -1 or k > V
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_masks_with_zero(logits, k):
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, 0.0)


def top_k_along_batch(logits, k):
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, min(k, logits.shape[0]), dim=0).values[-1:]   # wrong dimension
    return logits.masked_fill(logits < kth, float("-inf"))


# ------------------------------------------------------------------ planted bugs: ch01

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


def kv_mla_factor_two(cfg, dtype="bfloat16"):
    if cfg.attention == "mla":
        return 2 * cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * _BYTES[dtype]
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _BYTES[dtype]


def kv_fp8_two_bytes(cfg, dtype="bfloat16"):
    b = {**_BYTES, "fp8": 2}[dtype]
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * b
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * b


def kv_counts_query_heads(cfg, dtype="bfloat16"):
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * _BYTES[dtype]
    return 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * _BYTES[dtype]


def kv_forgets_values(cfg, dtype="bfloat16"):
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * _BYTES[dtype]
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _BYTES[dtype]


def plan_ignores_utilization(mem, util, weights, per_token, context):
    return max(0, mem - weights) // (per_token * context)


def plan_forgets_weights(mem, util, weights, per_token, context):
    return int(mem * util) // (per_token * context)


def plan_utilization_after_weights(mem, util, weights, per_token, context):
    return max(0, int((mem - weights) * util)) // (per_token * context)


def plan_goes_negative(mem, util, weights, per_token, context):
    return (int(mem * util) - weights) // (per_token * context)


def plan_rounds(mem, util, weights, per_token, context):
    return round(max(0, int(mem * util) - weights) / (per_token * context))


def plan_counts_tokens(mem, util, weights, per_token, context):
    return max(0, int(mem * util) - weights) // per_token


# exercise, bug, a check it must fail, words its message must contain
BUGS = [
    ("cached_attention", attn_mask_off_by_one, "prefill (start = 0)", "NaN"),
    ("cached_attention", attn_ignores_start, "chunk after a prefix", "offset is ignored"),
    ("cached_attention", attn_gqa_tiled, "GQA", "h % KVH"),
    ("cached_attention", attn_sdpa_is_causal, "chunk after a prefix",
     "scaled_dot_product_attention"),
    ("cached_attention", attn_does_not_write, "writes this step's k and v", "found at no position"),
    ("cached_attention", attn_writes_one_late, "writes this step's k and v", "found at [1]"),
    ("cached_attention", attn_reads_whole_slab, "decode step", "stale slots"),
    ("top_p_filter", top_p_drops_crossing_token, "always keeps the most likely token",
     "you kept token ids []"),
    ("top_p_filter", top_p_drops_crossing_token, "smallest set", "expected [0]"),
    ("top_p_filter", top_p_one_too_many, "smallest set", "you kept token ids [0, 1]"),
    ("top_p_filter", top_p_forgets_to_unsort, "not sorted", "original token ids"),
    ("top_p_filter", top_p_returns_probs, "returns logits", "kept logits were changed"),
    ("top_p_filter", top_p_flattens_batch, "each row of a batch", "3 rows, row "),
    ("top_k_filter", top_k_keeps_one_extra, "exactly the k largest", "k=1"),
    ("top_k_filter", top_k_no_special_cases, "k = -1", "raised RuntimeError"),
    ("top_k_filter", top_k_no_special_cases, "at or above the vocabulary", "raised"),
    ("top_k_filter", top_k_masks_with_zero, "returns logits", "must be -inf"),
    ("top_k_filter", top_k_along_batch, "each row of a batch", "3 rows, row "),
    ("kv_bytes_per_token", kv_mla_factor_two, "MLA", "no factor 2"),
    ("kv_bytes_per_token", kv_fp8_two_bytes, "fp8 and int8", "1 byte per element, not 2"),
    ("kv_bytes_per_token", kv_counts_query_heads, "GQA counts KV heads", "query heads"),
    ("kv_bytes_per_token", kv_forgets_values, "MHA", "factor 2 is missing"),
    ("max_concurrent_seqs", plan_ignores_utilization, "utilization caps the total",
     "ignored gpu_memory_utilization"),
    ("max_concurrent_seqs", plan_forgets_weights, "Llama-3-8B on an H100",
     "forgot to subtract the weights"),
    ("max_concurrent_seqs", plan_utilization_after_weights, "utilization caps the total",
     "memory left after the weights"),
    ("max_concurrent_seqs", plan_goes_negative, "do not fit", "never a negative"),
    ("max_concurrent_seqs", plan_rounds, "whole sequences only", "rounded to the nearest"),
    ("max_concurrent_seqs", plan_counts_tokens, "Llama-3-8B on an H100", "number of tokens"),
]


@pytest.mark.parametrize("name, bug, check, words", BUGS,
                         ids=[f"{b[0]}-{b[1].__name__}-{i}" for i, b in enumerate(BUGS)])
def test_planted_bug_is_caught_with_a_specific_message(name, bug, check, words):
    result = grade(GRADED[name][0], bug, time_limit=LIMIT)
    assert not result.full_marks, f"{bug.__name__} got full marks"
    failing = [m for m in result.messages if m.startswith(tuple(
        o.name for o in result.outcomes if check in o.name))]
    assert failing, f"no failed check matching {check!r}:\n{result}"
    assert any(words in m for m in failing), f"{words!r} missing from {failing}"


def test_every_exercise_has_at_least_two_planted_bugs():
    for name in GRADED:
        assert len({b.__name__ for n, b, _, _ in BUGS if n == name}) >= 2, name


def test_gqa_bug_fails_only_the_gqa_check():
    # checks are specific: a head-mapping mistake must not be blamed on the mask or the cache
    result = grade(ch00.CACHED_ATTENTION, attn_gqa_tiled, time_limit=LIMIT)
    assert result.failed == ["GQA: query head h reads KV head h // (H // KVH)"], str(result)


# ------------------------------------------------------------------ report and grade line

def test_report_prints_score_failures_and_grade_line(capsys):
    result = ch00.check_top_p(top_p_forgets_to_unsort, time_limit=LIMIT)
    out = capsys.readouterr().out
    assert out.startswith(f"top_p_filter: {result.score}/{result.max} checks passed\n")
    assert "  FAIL  keeps the right token ids when the vocabulary is not sorted: p=0.5" in out
    assert "  ok    always keeps the most likely token, even when p is below its probability" in out
    assert parse_grade_lines(out) == {"ch00.top_p": (result.score, result.max)}
    assert out.rstrip().endswith(f"[minillm-grade] ch00.top_p {result.score}/{result.max}")
    assert len(result.messages) == result.max - result.score


def test_parse_grade_lines_takes_the_last_line_and_ignores_other_text():
    text = ("[minillm-grade] ch00.top_p 1/6\nnoise [minillm-grade] ch00.top_k 5/5\n"
            "[minillm-grade] ch00.top_p 6/6\n")
    assert parse_grade_lines(text) == {"ch00.top_p": (6, 6)}


# ------------------------------------------------------------------ time limits

def spin_forever(*args, **kwargs):
    while True:
        pass


def raise_index_error(*args, **kwargs):
    return [][3]


def test_run_with_time_limit_kills_an_infinite_loop():
    t0 = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="within 1 s"):
        run_with_time_limit(spin_forever, time_limit=1)
    assert time.monotonic() - t0 < 10


def test_run_with_time_limit_reports_an_exception_with_its_line():
    with pytest.raises(LearnerError) as info:
        run_with_time_limit(raise_index_error, time_limit=LIMIT)
    assert info.value.type_name == "IndexError"
    assert "out of range" in info.value.detail
    assert info.value.where.startswith("in raise_index_error, line")


def _matmul_sum(n):
    x = torch.arange(n * n, dtype=torch.float32).reshape(n, n) / (n * n)
    return float((x @ x).softmax(-1).sum())


def test_torch_works_in_the_forked_child_after_the_parent_used_threads():
    # An OpenMP pool started in the parent does not survive fork(); without the child's
    # torch.set_num_threads(1) this multi-threaded matmul would hang until the time limit.
    torch.set_num_threads(2)
    expected = _matmul_sum(512)                          # starts the parent's thread pool
    assert run_with_time_limit(_matmul_sum, 512, time_limit=LIMIT, isolation="fork") == \
        pytest.approx(expected)


def test_thread_isolation_returns_values_and_reports_exceptions():
    assert run_with_time_limit(_matmul_sum, 64, time_limit=LIMIT, isolation="thread") == \
        pytest.approx(_matmul_sum(64))
    with pytest.raises(LearnerError, match="IndexError"):
        run_with_time_limit(raise_index_error, time_limit=LIMIT, isolation="thread")


def test_grade_survives_an_infinite_loop_and_keeps_earlier_results():
    def quick(fn):
        pass

    exercise = Exercise("test.loop", "f", (Check("first", quick),
                                           Check("second", lambda fn: fn()),
                                           Check("third", quick)))
    t0 = time.monotonic()
    result = grade(exercise, spin_forever, time_limit=1)
    assert time.monotonic() - t0 < 10
    assert [o.ok for o in result.outcomes] == [True, False, False]
    assert "did not finish within the time limit of 1 s" in result.outcomes[1].message
    assert result.outcomes[2].message.startswith("not run")


def test_a_check_fails_by_raising_problem_and_passes_by_returning():
    """The one check dialect: Problem's text is the message; a check that returns a value (an
    old-style `return ok, message`) is a grader bug and fails loudly instead of passing."""
    from minillm.grading.core import Problem

    def positive(fn):
        if fn() <= 0:
            raise Problem(f"you returned {fn()}; expected a positive number")

    def old_style(fn):
        return fn() > 0, "expected a positive number"

    exercise = Exercise("test.dialect", "f", (Check("positive", positive),
                                              Check("old style", old_style)))
    good = grade(exercise, lambda: 3, isolation="none")
    assert [o.ok for o in good.outcomes] == [True, False]
    assert "grader error: the check returned tuple" in good.outcomes[1].message
    bad = grade(exercise, lambda: -1, isolation="none")
    assert bad.outcomes[0].message == "you returned -1; expected a positive number"


def test_grade_reports_a_raising_learner_and_a_crashing_one():
    result = grade(ch00.TOP_K, raise_index_error, time_limit=LIMIT)
    assert result.score == 0
    assert "your code raised IndexError" in result.messages[0]
    assert "in raise_index_error, line" in result.messages[0]

    def exits(*args):
        os._exit(3)

    result = grade(ch01.KV_BYTES, exits, time_limit=LIMIT, isolation="fork")
    assert result.score == 0
    assert "crashed: the process running it exited with status 3" in result.messages[0]


def test_time_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINILLM_GRADE_TIME_LIMIT", "0.5")
    t0 = time.monotonic()
    result = grade(ch00.TOP_P, spin_forever)
    assert time.monotonic() - t0 < 8
    assert "time limit of 0.5 s" in result.messages[0]
    monkeypatch.setenv("MINILLM_GRADE_TIME_LIMIT", "soon")
    with pytest.raises(ValueError, match="MINILLM_GRADE_TIME_LIMIT"):
        grade(ch00.TOP_P, spin_forever)


def test_grade_rejects_a_non_function():
    result = grade(ch00.TOP_P, "top_p_filter", time_limit=LIMIT)
    assert result.score == 0 and "expected a function, got str" in result.messages[0]


# ------------------------------------------------------------------ batch grading

def _with_cell_edit(src: Path, dst: Path, edit):
    nb = nbformat.read(str(src), as_version=4)
    edit(nb)
    nbformat.write(nb, str(dst))


def _cell_defining(nb, name):
    return next(c for c in nb.cells if c.cell_type == "code" and f"def {name}(" in c.source)


def _syntax_error(nb):
    cell = _cell_defining(nb, "kv_bytes_per_token")
    cell.source = cell.source.replace("    return 2 *", "    return 2 * (", 1)


def _loop_in_planner(nb):
    cell = _cell_defining(nb, "max_concurrent_seqs")
    cell.source = cell.source.replace("    ### BEGIN SOLUTION", "    ### BEGIN SOLUTION\n"
                                      "    while True:\n        pass")


def test_instructor_command_writes_one_row_per_submission(tmp_path):
    subs = tmp_path / "submissions"
    (subs / "carol").mkdir(parents=True)
    _with_cell_edit(SOLUTIONS / "01_kv_cache_math.ipynb", subs / "alice_01_kv_cache_math.ipynb",
                    lambda nb: None)
    _with_cell_edit(EXERCISES / "00_foundations.ipynb", subs / "bob_00_foundations.ipynb",
                    lambda nb: None)
    _with_cell_edit(SOLUTIONS / "01_kv_cache_math.ipynb", subs / "carol" / "01_kv_cache_math.ipynb",
                    _syntax_error)
    (subs / "dan_01_kv_cache_math.ipynb").write_text("{ this is not json")
    out = tmp_path / "scores.csv"
    proc = subprocess.run([sys.executable, "-m", "minillm.grading", str(EXERCISES),
                           "--submissions", str(subs), "--out", str(out), "--timeout", "240",
                           "--check-time-limit", "30"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, newline="") as f:
        rows = {r["submission"]: r for r in csv.DictReader(f)}
    ids = [e.id for e in ch00.EXERCISES + ch01.EXERCISES]
    assert list(next(iter(rows.values())))[:2 + len(ids)] == ["submission", "problem_set", *ids]
    assert set(rows) == {"alice_01_kv_cache_math.ipynb", "bob_00_foundations.ipynb",
                         "carol/01_kv_cache_math.ipynb", "dan_01_kv_cache_math.ipynb"}

    alice = rows["alice_01_kv_cache_math.ipynb"]
    assert alice["status"] == "ok"
    assert alice["ch01.kv_bytes_per_token"] == "6" and alice["ch01.max_concurrency"] == "6"
    assert alice["ch00.top_p"] == ""                      # not part of this problem set
    assert alice["total"] == alice["max"] == "12"

    bob = rows["bob_00_foundations.ipynb"]
    assert bob["problem_set"] == "00_foundations"
    assert [bob[e.id] for e in ch00.EXERCISES] == ["0"] * len(ch00.EXERCISES)
    assert bob["total"] == "0" and bob["max"] == str(sum(e.max for e in ch00.EXERCISES))

    carol = rows["carol/01_kv_cache_math.ipynb"]
    assert carol["ch01.kv_bytes_per_token"] == "0"        # its cell did not compile
    assert carol["ch01.max_concurrency"] == "6"           # the other exercise still counts
    assert "SyntaxError" in carol["status"]

    dan = rows["dan_01_kv_cache_math.ipynb"]
    assert dan["status"].startswith("not a readable notebook") and dan["total"] == "0"


def test_batch_grading_survives_an_infinite_loop(tmp_path):
    # The loop is in the learner's function: its check group hits the check time limit, and the
    # next cell, which calls the function directly, hits the notebook's own time limit.
    path = tmp_path / "erin_01_kv_cache_math.ipynb"
    _with_cell_edit(SOLUTIONS / "01_kv_cache_math.ipynb", path, _loop_in_planner)
    row = grade_submission(path, problem_sets(EXERCISES), timeout=20, check_time_limit=8)
    assert row.scores == {"ch01.kv_bytes_per_token": 6, "ch01.max_concurrency": 0}, \
        (row.status, row.results["ch01.kv_bytes_per_token"].messages)
    assert "time limit of 20 s reached in cell" in row.status


def test_grade_folder_rejects_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        grade_folder(EXERCISES, tmp_path / "nope", log=None)
    with pytest.raises(ValueError, match="no exercise notebooks"):
        grade_folder(tmp_path, tmp_path, log=None)
