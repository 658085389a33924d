"""The 45-minute mock design interview.

Five timed phases (clarify 5 / high-level design 10 / deep dive 15 / scale and trade-offs 10 /
wrap-up 5 minutes). A design prompt is drawn from bank/mock.yaml; in the deep dive the candidate
gives a capacity estimate that is checked against minillm.kvmath.plan_capacity; in the scale phase
follow-up questions from the bank are asked and graded. Each criterion gets a 1-5 score and a
markdown report is written at the end. A phase whose notes are a keyword salad or run far past
its minutes is capped at 2 of 5 (`phase_shape_reason`).

The clock and the input/output functions are parameters, so a test can run a whole interview in
milliseconds with a fake clock.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from .. import configs, kvmath
from .bank import BANK_DIR, _point, get
from .shape import salad_reason, words
from .units import UnitError, fmt_bytes, parse_quantity

END = "."          # a line with just a dot ends a phase's notes


def load_mock(path=None) -> dict:
    with open(path or BANK_DIR / "mock.yaml", encoding="utf-8") as f:
        data = yaml.safe_load(f)
    for phase in data["phases"]:
        phase["checklist"] = [_point(p) for p in phase["checklist"]]
    return data


@dataclass
class PhaseResult:
    name: str
    budget_s: float
    used_s: float
    notes: str
    hits: list
    missed: list

    @property
    def over_s(self) -> float:
        return max(0.0, self.used_s - self.budget_s)


@dataclass
class MockResult:
    prompt: dict
    phases: list = field(default_factory=list)
    estimate: float = None                  # candidate's concurrency estimate
    truth: object = None                    # kvmath.CapacityPlan
    followups: list = field(default_factory=list)   # (question id, prompt, response, score,
                                                    #  feedback)
    rubric: dict = field(default_factory=dict)       # criterion -> (score 1-5, why)
    report_path: Path = None


# A phase whose notes list the checklist's terms without saying anything (a keyword salad), or
# run far past what the phase's minutes allow, scores at most this, however many terms it hits.
SHAPE_CAP = 2
WORDS_PER_MINUTE = 40          # notes of a spoken answer: about what fits in the phase's time
NOTES_FUNCTION_SHARE = 0.08    # terse notes ("decision: TP=2, FP8 weights; measure p99") pass
NOTES_FRAGMENT_WORDS = 2.0


def phase_shape_reason(notes: str, minutes: float) -> str:
    """'' when a phase's notes read as an answer; else why they do not."""
    n = len(words(notes))
    if n > WORDS_PER_MINUTE * minutes:
        return (f"{n} words for a {minutes:g}-minute phase: an interviewer hears the decisions, "
                "not everything you know")
    return salad_reason(notes, NOTES_FUNCTION_SHARE, NOTES_FRAGMENT_WORDS)


def _coverage_score(hits: int, total: int) -> int:
    """1-5 from the share of checklist points covered."""
    return 1 + round(4 * hits / total) if total else 1


def estimate_score(estimate, truth: int) -> tuple[int, str]:
    if estimate is None:
        return 1, "no usable estimate given"
    if truth <= 0:
        return 1, "the deployment does not fit"
    err = abs(estimate - truth) / truth
    for limit, score in ((0.10, 5), (0.25, 4), (0.5, 3), (1.0, 2)):
        if err <= limit:
            return score, f"estimate {estimate:,.0f} vs {truth:,} ({err:.0%} off)"
    return 1, f"estimate {estimate:,.0f} vs {truth:,} ({err:.0%} off)"


def _read_notes(input_fn: Callable) -> str:
    lines = []
    while True:
        try:
            line = input_fn("  | ")
        except EOFError:
            break
        if line.strip() == END:
            break
        lines.append(line)
    return "\n".join(lines)


def run_mock(seed=0, input_fn: Callable = input, output_fn: Callable = print,
             clock: Callable = time.monotonic, report_dir=None, prompt_id: str = None,
             num_followups: int = 2, mock_path=None) -> MockResult:
    data = load_mock(mock_path)
    rng = random.Random(f"mock:{seed}")
    prompts = data["prompts"]
    if prompt_id is not None:
        matches = [p for p in prompts if p["id"] == prompt_id]
        if not matches:
            raise ValueError(f"unknown design prompt {prompt_id!r}; use one of: "
                             f"{', '.join(p['id'] for p in prompts)}")
        prompt = matches[0]
    else:
        prompt = rng.choice(prompts)
    dep = prompt["deployment"]
    cfg = configs.get(dep["model"])
    truth = kvmath.plan_capacity(dep["gpu"], cfg, dep["weight_dtype"], dep["kv_dtype"],
                                 dep["util"], dep["context"], 0, dep["num_gpus"])
    result = MockResult(prompt=prompt, truth=truth)
    total_min = sum(p["minutes"] for p in data["phases"])
    output_fn(f"Mock design interview ({total_min} minutes): {prompt['title']}")
    output_fn(prompt["brief"])
    output_fn(f"Type your answer for each phase; a line with just '{END}' ends the phase.")
    start = clock()
    for phase in data["phases"]:
        budget = phase["minutes"] * 60
        elapsed = (clock() - start) / 60
        output_fn(f"\n== {phase['name']} ({phase['minutes']} min; {elapsed:.0f} of {total_min} "
                  f"min used) ==\n{phase['goal']}")
        if elapsed >= total_min:
            output_fn(f"(the {total_min} minutes are up: in a real interview you would be cut off "
                      "here; answer in one or two lines)")
        t0 = clock()
        if phase["name"] == "deep dive":
            _capacity_check(result, dep, cfg, input_fn, output_fn)
        notes = _read_notes(input_fn)
        if phase["name"] == "scale and trade-offs":
            _followups(result, prompt, rng, num_followups, input_fn, output_fn)
        used = clock() - t0
        text = notes.lower()
        hits = [p["says"] for p in phase["checklist"]
                if any(re.search(rx, text) for rx in p["any"])]
        missed = [p["says"] for p in phase["checklist"] if p["says"] not in hits]
        pr = PhaseResult(phase["name"], budget, used, notes, hits, missed)
        result.phases.append(pr)
        if pr.over_s:
            output_fn(f"(over time by {pr.over_s / 60:.1f} min)")
    _score(result, data)
    result.report_path = write_report(result, report_dir)
    output_fn("\nRubric: " + ", ".join(f"{k} {v[0]}/5" for k, v in result.rubric.items()))
    output_fn(f"Report written to {result.report_path}")
    return result


def _capacity_check(result, dep, cfg, input_fn, output_fn) -> None:
    where = f"{dep['num_gpus']} x {dep['gpu']}" if dep["num_gpus"] > 1 else f"one {dep['gpu']}"
    output_fn(f"Back of the envelope: {cfg.name} with {dep['weight_dtype']} weights and "
              f"{dep['kv_dtype']} KV on {where}, the engine using {dep['util']:g} of the memory. "
              f"How many sequences of {dep['context']:,} tokens can be cached at once?")
    for _ in range(3):
        try:
            response = input_fn("estimate> ")
        except EOFError:
            return
        try:
            result.estimate = parse_quantity(response, "count").value
            break
        except UnitError as exc:
            output_fn(f"{exc}; try again (a whole number)")
    t = result.truth
    score, why = estimate_score(result.estimate, t.max_seqs)
    output_fn(f"kvmath: pool {fmt_bytes(t.kv_pool_bytes)} / {t.kv_bytes_per_token:,} B per token = "
              f"{t.max_tokens:,} tokens = {t.max_seqs} sequences of {t.context_len:,}. ({why})")


def _followups(result, prompt, rng, n, input_fn, output_fn) -> None:
    ids = list(prompt.get("followups", []))
    rng.shuffle(ids)
    for qid in ids[:n]:
        inst = get(qid).instance(0)
        output_fn(f"\nFollow-up: {inst.prompt}")
        try:
            response = input_fn("answer> ")
        except EOFError:
            response = ""
        grade = inst.grade(response)
        output_fn(grade.feedback)
        result.followups.append((qid, inst.prompt, response, grade.score, grade.feedback))


def _score(result: MockResult, data: dict) -> None:
    by = {p.name: p for p in result.phases}

    def cov(name):
        p = by.get(name)
        if p is None:
            return 1, "phase not reached"
        total = len(p.hits) + len(p.missed)
        score, why = _coverage_score(len(p.hits), total), (
            f"covered {len(p.hits)}/{total}"
            + (f"; missing: {', '.join(p.missed)}" if p.missed else ""))
        shape = phase_shape_reason(p.notes, p.budget_s / 60)
        if shape and score > SHAPE_CAP:
            score, why = SHAPE_CAP, f"{why}; capped at {SHAPE_CAP}: {shape}"
        return score, why

    r = {}
    r["requirements"] = cov("clarify")
    r["high-level design"] = cov("high-level design")
    est, why = estimate_score(result.estimate, result.truth.max_seqs)
    dd, dd_why = cov("deep dive")
    r["memory math"] = (est, why)
    r["deep dive"] = (dd, dd_why)
    sc, sc_why = cov("scale and trade-offs")
    if result.followups:
        f = sum(x[3] for x in result.followups) / len(result.followups)
        sc = max(1, min(5, round((sc + 1 + 4 * f) / 2)))
        sc_why += f"; follow-ups {f:.0%}"
    r["scale and trade-offs"] = (sc, sc_why)
    overruns = [p for p in result.phases if p.over_s > 0]
    wrap, wrap_why = cov("wrap-up")
    comm = max(1, min(5, round((5 - len(overruns) + wrap) / 2)))
    r["communication and time"] = (comm, f"{len(overruns)} phase(s) over time; wrap-up {wrap_why}")
    result.rubric = r


def write_report(result: MockResult, report_dir=None) -> Path:
    from .state import drill_dir
    report_dir = Path(report_dir) if report_dir else drill_dir() / "mock-reports"
    report_dir.mkdir(parents=True, exist_ok=True)
    p = result.prompt
    path = report_dir / f"mock-{p['id']}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    n = 1
    while path.exists():
        path = report_dir / f"mock-{p['id']}-{time.strftime('%Y%m%d-%H%M%S')}-{n}.md"
        n += 1
    t = result.truth
    lines = [f"# Mock interview: {p['title']}", "", p["brief"], "", "## Time", "",
             "| phase | budget | used | over |", "|---|---:|---:|---:|"]
    for ph in result.phases:
        lines.append(f"| {ph.name} | {ph.budget_s / 60:.0f} min | {ph.used_s / 60:.1f} min | "
                     f"{ph.over_s / 60:.1f} min |")
    total_used = sum(ph.used_s for ph in result.phases) / 60
    lines += ["", f"Total: {total_used:.1f} of "
              f"{sum(ph.budget_s for ph in result.phases) / 60:.0f} min.",
              "", "## Capacity estimate", "",
              f"Your estimate: {'none' if result.estimate is None else f'{result.estimate:,.0f}'} "
              f"sequences of {t.context_len:,} tokens.",
              f"minillm.kvmath.plan_capacity: {t.gpu}, usable {fmt_bytes(t.usable_bytes)}, weights "
              f"{fmt_bytes(t.weight_bytes)}, KV pool {fmt_bytes(t.kv_pool_bytes)}, "
              f"{t.kv_bytes_per_token:,} B per token -> {t.max_tokens:,} tokens -> "
              f"**{t.max_seqs} sequences**.", "", "## Rubric (1-5)", "",
              "| criterion | score | why |", "|---|---:|---|"]
    for k, (s, why) in result.rubric.items():
        lines.append(f"| {k} | {s} | {why} |")
    total = sum(s for s, _ in result.rubric.values())
    lines += ["", f"Total: {total} / {5 * len(result.rubric)}", "", "## Your notes", ""]
    for ph in result.phases:
        lines += [f"### {ph.name}", "", ph.notes or "_(nothing written)_", ""]
        if ph.missed:
            lines += ["Not mentioned: " + "; ".join(ph.missed) + ".", ""]
    if result.followups:
        lines += ["## Follow-up questions", ""]
        for _qid, q, resp, score, fb in result.followups:
            lines += [f"**{q}**", "", f"Your answer: {resp or '_(none)_'}", "",
                      f"Score {score:.2f}.", "", "```", fb, "```", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
