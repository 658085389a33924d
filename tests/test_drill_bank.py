"""The drill's question bank: schema, stable ids, real section references, and grading that
gives the model answer full marks and wrong answers none."""
import json
import re
from pathlib import Path

import pytest

from minillm import drill
from minillm.drill import bank as bank_mod
from minillm.drill.units import UnitError, parse_quantity

ROOT = Path(__file__).resolve().parents[1]
BANK = drill.load_bank()
SEEDS = (0, 1, 2)


def test_bank_size_and_schema():
    assert len(BANK) >= 250
    ids = [q.id for q in BANK]
    assert len(ids) == len(set(ids))
    for q in BANK:
        assert q.kind in drill.KINDS
        assert q.topic in drill.topics()
        assert q.difficulty in (1, 2, 3)
        assert q.section and all(re.match(r"^notebooks/\d\d_[a-z0-9_]+\.ipynb#.+$", s)
                                 for s in q.section)
    kinds = {q.kind for q in BANK}
    assert kinds == set(drill.KINDS)


def test_every_topic_has_questions():
    by_topic = {t: [q for q in BANK if q.topic == t] for t in drill.topics()}
    assert all(by_topic.values()), [t for t, qs in by_topic.items() if not qs]


def test_ids_are_stable():
    """Progress files, review state and Anki GUIDs key on ids: once published, an id stays."""
    published = (ROOT / "tests/data/drill_ids.txt").read_text().split()
    missing = sorted(set(published) - {q.id for q in BANK})
    assert not missing, f"question ids removed or renamed: {missing}"


def _headings(nb_path: Path) -> set:
    nb = json.loads(nb_path.read_text())
    out = set()
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"^#{1,6}\s+(.*\S)\s*$", line)
                if m:
                    out.add(m.group(1))
    return out


def test_every_section_reference_names_a_real_heading():
    cache, bad = {}, []
    refs = {s for q in BANK for s in q.section} | set(bank_mod.section_aliases().values())
    for ref in sorted(refs):
        path, heading = ref.split("#", 1)
        nb = ROOT / path
        if not nb.exists():
            bad.append(f"{ref}: no such notebook")
            continue
        cache.setdefault(path, _headings(nb))
        if heading not in cache[path]:
            bad.append(f"{ref}: no such heading")
    assert not bad, "\n".join(bad)


def test_instances_are_deterministic_per_seed():
    for q in BANK:
        a, b = q.instance(5), q.instance(5)
        assert (a.prompt, a.answer) == (b.prompt, b.answer), q.id
    numeric = [q for q in BANK if q.kind == "numeric"]
    varied = sum(len({q.instance(s).prompt for s in range(6)}) > 1 for q in numeric)
    assert varied == len(numeric), "every generator should draw fresh parameters per seed"


@pytest.mark.parametrize("q", BANK, ids=lambda q: q.id)
def test_model_answer_scores_full_marks_and_wrong_answers_do_not(q):
    for seed in SEEDS:
        inst = q.instance(seed)
        g = inst.grade(inst.answer)
        assert g.score == 1.0, (q.id, seed, g.feedback)
        assert (f"see {q.not_taught}" if q.not_taught else q.section[0]) in g.feedback
        if q.kind == "numeric":
            wrong = inst.grade(f"{inst.value * 1.5 + 7:.6g}")     # bare number: base unit
            assert wrong.score == 0.0, (q.id, wrong.feedback)
            assert "Working:" in wrong.feedback
        elif q.kind == "concept":
            assert inst.grade("").score == 0.0
            assert inst.grade("I am not sure, something about computers.").score < 0.5
        else:
            letters = "ABCDEFGH"[:len(inst.options)]
            for letter in letters:
                if letter != inst.correct_letter:
                    assert inst.grade(letter).score == 0.0
            assert inst.grade(inst.correct_letter.lower() + ")").score == 1.0


def test_spot_the_error_feedback_gives_the_fact_with_computed_figures():
    q = drill.get("err.llama70b-half-mb")
    inst = q.instance(0)
    wrong = next(l for l in "ABCD" if l != inst.correct_letter)
    fb = inst.grade(wrong).feedback
    assert ("The correct fact:" in fb and "327,680 B" in fb
            and "notebooks/01_kv_cache_math.ipynb#" in fb)
    assert "[[" not in fb


def test_every_listed_error_has_a_spot_the_error_item():
    errors = drill.load_bank(kind="spot_the_error")
    assert len(errors) >= 46          # 12 known + 34 found since (one merged, one not an error,
                                      # some split)


def test_numeric_grading_accepts_units_and_names_slips():
    q = drill.get("num.kv-per-token.gqa")
    inst = next(q.instance(s) for s in range(50) if q.instance(s).params["model"] == "llama-2-70b")
    assert inst.value == 327680
    for ok in ("327680", "327,680 B", "320 KiB", "320KiB", "0.3125 MiB", "327.68 KB",
               "3.2768e5 bytes"):
        assert inst.grade(ok).score == 1.0, ok
    slip = inst.grade("320 KB")                          # decimal where binary was meant
    assert slip.score == 0.0 and "decimal and binary" in slip.feedback
    half = inst.grade("163840")
    assert half.score == 0.0 and "factor of 2" in half.feedback
    bad = inst.grade("about a third of a megabyte")
    assert bad.score == 0.0 and "expected a size" in bad.feedback and "320 KiB" in bad.feedback
    wrong_dim = inst.grade("20 ms")
    assert wrong_dim.score == 0.0 and "unit of seconds" in wrong_dim.feedback


def test_time_answers_accept_ms_and_us():
    q = drill.get("num.decode-step-time")
    inst = q.instance(3)
    ms = inst.value * 1e3
    assert inst.grade(f"{ms:.4f} ms").score == 1.0
    assert inst.grade(f"{ms * 1e3:.1f} us").score == 1.0
    assert inst.grade(f"{ms:.4f}").score == 1.0          # bare number: the question's unit (ms)
    assert inst.grade(f"{inst.value:.6f} s").score == 1.0


def test_parse_quantity_units():
    assert parse_quantity("1 KB", "bytes").value == 1000
    assert parse_quantity("1 KiB", "bytes").value == 1024
    assert parse_quantity("2 GiB", "bytes").value == 2 * 2**30
    assert parse_quantity("1.5 GB", "bytes").value == 1.5e9
    assert parse_quantity("250 us", "seconds").value == pytest.approx(250e-6)
    assert parse_quantity("78%", "fraction").value == pytest.approx(0.78)
    assert parse_quantity("1.6x", "ratio").value == 1.6
    assert parse_quantity("$0.42", "dollars").value == 0.42
    for bad, dim in (("", "bytes"), ("lots", "count"), ("5 parsecs", "bytes"),
                     ("3 tokens", "bytes")):
        with pytest.raises(UnitError):
            parse_quantity(bad, dim)


def test_unknown_topic_or_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown topic 'kv'.*kv_cache"):
        drill.load_bank(topic="kv")
    with pytest.raises(ValueError, match="unknown kind 'essay'.*concept"):
        drill.load_bank(kind="essay")
    assert {q.topic for q in drill.load_bank(topic="kv_cache")} == {"kv_cache"}
    assert {q.kind for q in drill.load_bank(kind="numeric", topic="foundations")} == {"numeric"}


def test_bank_validation_names_the_problem(tmp_path):
    import shutil
    for name in ("sections.yaml", "topics.yaml"):
        shutil.copy(bank_mod.BANK_DIR / name, tmp_path / name)
    (tmp_path / "q_bad.yaml").write_text(
        "- id: x.one\n  kind: concept\n  topic: kv_cache\n  difficulty: 1\n"
        "  section: [notebooks/99_nope.ipynb]\n  prompt: p\n  answer: a\n  points: ['p :: a']\n")
    with pytest.raises(drill.BankError, match="x.one.*section"):
        bank_mod._load.__wrapped__(str(tmp_path))


def test_concept_points_tell_answers_apart():
    """Key points must be specific: the model answers of other topics' questions score low."""
    concepts = drill.load_bank(kind="concept")
    answers = [(q.topic, q.instance(0).answer) for q in concepts]
    means = {}
    for q in concepts:
        inst = q.instance(0)
        scores = [inst.grade(a).score for t, a in answers if t != q.topic]
        means[q.id] = sum(scores) / len(scores)
    loose = {k: round(v, 2) for k, v in means.items() if v >= 0.3}
    assert not loose, f"key points that match unrelated answers: {loose}"
    assert sum(means.values()) / len(means) < 0.15
