"""The question bank: YAML files in `bank/`, loaded into Question objects.

    from minillm import drill
    bank = drill.load_bank()
    q = bank[0]                       # .id .kind .topic .difficulty .section
    inst = q.instance(seed=0)         # .prompt .answer
    g = inst.grade("320 KiB")         # g.score in [0, 1], g.feedback

Five kinds share one interface:
- concept: free text, scored by the key points it mentions (each point lists accepted phrasings);
- numeric: a generator draws fresh parameters per seed; the answer comes from minillm's arithmetic;
- choice, spot_the_error, scenario: lettered options, shuffled per seed.
"""
from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from . import generators
from .facts import render
from .shape import overlong_reason, salad_reason, words
from .units import UnitError, compare, fmt_value, parse_quantity

BANK_DIR = Path(__file__).with_name("bank")
# Answers longer than this are refused before grading, with a message. A full answer to any
# question in the bank fits in a few hundred characters; the cap keeps grading instant (the
# concept patterns, e.g. 'prefill.*compute', cost time quadratic in the length: a 320 kB answer
# took 5.5 s, a 4,000-character one takes about a millisecond).
MAX_ANSWER_CHARS = 4000

# A concept answer that states a known wrong claim, lists terms without sentences, or runs many
# times longer than the model answer scores at most this, whatever key points it hits.
CAPPED_SCORE = 0.5

KINDS = ("concept", "numeric", "spot_the_error", "scenario", "choice")
DIFFICULTIES = (1, 2, 3)                   # 1 easy, 2 medium, 3 hard
_SECTION = re.compile(r"^notebooks/(\d\d)_[a-z0-9_]+\.ipynb#.+$")
_ID = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


@dataclass(frozen=True)
class Grade:
    score: float                           # in [0, 1]
    feedback: str

    @property
    def correct(self) -> bool:
        return self.score >= 0.999

    def __iter__(self):                    # score, feedback = inst.grade(...)
        return iter((self.score, self.feedback))


def overlong(response) -> str:
    """'' when the answer is short enough to grade; else why not, and the fix."""
    n = len(str(response or ""))
    if n <= MAX_ANSWER_CHARS:
        return ""
    return (f"the answer is {n:,} characters, longer than the {MAX_ANSWER_CHARS:,} the drill "
            "grades. Shorten it to the key points (a few sentences, or a number with its unit) "
            "and answer again.")


@dataclass
class Instance:
    question: "Question"
    seed: object
    prompt: str
    answer: str                            # model answer (concept), value with unit (numeric),
                                           # letter + text (options)
    value: Optional[float] = None          # numeric only, in the base unit of `dimension`
    dimension: str = ""
    options: list = field(default_factory=list)   # lettered kinds: option texts in display order
    correct_letter: str = ""
    params: dict = field(default_factory=dict)    # numeric: the drawn parameters
    _numeric: Optional[generators.Numeric] = None

    def grade(self, response) -> Grade:
        q = self.question
        too_long = overlong(response)
        if too_long:
            return Grade(0.0, f"Not graded: {too_long}")
        if q.kind == "numeric":
            return self._grade_numeric(response)
        if q.kind == "concept":
            return self._grade_concept(response)
        return self._grade_letter(response)

    # --- numeric -------------------------------------------------------------------------
    def _grade_numeric(self, response) -> Grade:
        n = self._numeric
        tol = (f"within {n.rel_tol * 100:g}%" if n.rel_tol else "exactly") + \
              (f" (or +-{n.abs_tol:g})" if n.abs_tol else "")
        try:
            got = parse_quantity(str(response), n.dimension, n.unit)
        except UnitError as exc:
            return Grade(0.0, f"Could not grade: {exc}. The answer is {self.answer}.\n"
                              f"Working: {n.working}\n{self.question.see_also()}")
        ok, slip = compare(n.value, got.value, n.rel_tol, n.abs_tol)
        shown = fmt_value(got.value, n.dimension)
        head = (f"Correct ({shown}, {tol})." if ok else
                f"Not quite: you gave {shown}; the answer is {self.answer}, accepted {tol}."
                + (f" {slip[0].upper()}{slip[1:]}." if slip else ""))
        return Grade(1.0 if ok else 0.0,
                     f"{head}\nWorking: {n.working}\n{self.question.see_also()}")

    # --- concept -------------------------------------------------------------------------
    def _grade_concept(self, response) -> Grade:
        q = self.question
        text = str(response or "").lower()
        hit, missed = [], []
        for point in q.points:
            (hit if any(re.search(p, text) for p in point["any"]) else missed).append(point["says"])
        score = len(hit) / len(q.points)
        lines = [f"Score {score:.2f}: {len(hit)} of {len(q.points)} key points."]
        if missed:
            lines.append("Missing: " + "; ".join(missed) + ".")
        caps = [f"Misconception: {w['says']}" for w in q.wrong
                if any(re.search(p, text) for p in w["any"])]
        # a question whose model answer is itself a list (metrics to track, keywords) takes one
        shape = ((salad_reason(response) if not salad_reason(self.answer) else "")
                 or overlong_reason(response, len(words(self.answer))))
        if shape:
            caps.append(f"Not an answer yet: {shape}.")
        if caps and score > CAPPED_SCORE:
            score = CAPPED_SCORE
            lines[0] = f"Score {score:.2f} (capped): {len(hit)} of {len(q.points)} key points."
        lines += caps
        lines.append(f"Model answer: {self.answer}")
        lines.append(q.see_also())
        return Grade(score, "\n".join(lines))

    # --- lettered options ----------------------------------------------------------------
    def _grade_letter(self, response) -> Grade:
        letters = "ABCDEFGH"[:len(self.options)]
        text = str(response or "").strip()
        m = re.match(r"^\(?([A-Ha-h])\)?(?:[.):\s]|$)", text)
        pick = m.group(1).upper() if m else None
        if pick is None:                                    # the option text itself
            for letter, opt in zip(letters, self.options):
                if text and text.lower() == opt.lower():
                    pick = letter
        if pick is None or pick not in letters:
            return Grade(0.0, f"Could not grade {text!r}: answer with one letter, "
                              f"{', '.join(letters)}. The answer is {self.answer}.\n"
                              f"{self._explanation()}")
        ok = pick == self.correct_letter
        head = "Correct." if ok else f"Not this one: {pick}) {self.options[letters.index(pick)]}"
        return Grade(1.0 if ok else 0.0,
                     f"{head}\nAnswer: {self.answer}\n{self._explanation()}")

    def _explanation(self) -> str:
        q = self.question
        parts = []
        if q.fact:
            parts.append(("The correct fact: " if q.kind == "spot_the_error" else "Why: ")
                         + render(q.fact))
        parts.append(q.see_also())
        return "\n".join(parts)


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    topic: str
    difficulty: int
    section: tuple                          # ("notebooks/NN_name.ipynb#Heading", ...)
    prompt: str = ""                        # concept/choice: the question; spot: the claim
    answer: str = ""                        # concept: the model answer
    points: tuple = ()                      # concept: ({"says": ..., "any": [regex, ...]}, ...)
    wrong: tuple = ()                       # concept: known wrong claims, same shape; "says"
                                            # is the correction printed when one matches
    not_taught: str = ""                    # a public source, when no lecture teaches it yet
    options: tuple = ()                     # lettered kinds: the first one is the right one
    fact: str = ""                          # lettered kinds: the explanation / correct fact
    metrics: tuple = ()                     # scenario: ((name, low, high, unit), ...)
    generator: str = ""                     # numeric
    params: tuple = ()                      # numeric: generator options as sorted
                                            # (key, value) pairs
    source_file: str = ""

    @property
    def chapter(self) -> str:
        return _SECTION.match(self.section[0]).group(1)

    def see_also(self) -> str:
        if self.not_taught:
            return f"Not taught in this course yet; see {self.not_taught}"
        return "See: " + "; ".join(self.section)

    def instance(self, seed=0) -> Instance:
        if self.kind == "numeric":
            n = generators.make_numeric(self.generator, f"{self.id}:{seed}", dict(self.params))
            answer = fmt_value(n.value, n.dimension)
            return Instance(self, seed, n.prompt, answer, value=n.value, dimension=n.dimension,
                            params=n.params, _numeric=n)
        if self.kind == "concept":
            return Instance(self, seed, render(self.prompt), render(self.answer))
        rng = random.Random(f"{self.id}:{seed}")
        order = list(range(len(self.options)))
        rng.shuffle(order)
        opts = [render(self.options[i]) for i in order]
        letter = "ABCDEFGH"[order.index(0)]
        lines = []
        if self.kind == "spot_the_error":
            lines.append(f"A common claim: \"{render(self.prompt)}\"")
            lines.append("What is wrong with it?")
        elif self.kind == "scenario":
            lines.append(render(self.prompt))
            for name, low, high, unit in self.metrics:
                v = low if low == high else rng.uniform(low, high)
                if isinstance(low, int) and isinstance(high, int):
                    v = round(v)                            # counts stay whole
                shown = f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"
                lines.append(f"  {name}: {shown}{unit}")
            lines.append("Most likely cause and first fix?")
        else:
            lines.append(render(self.prompt))
        lines += [f"  {'ABCDEFGH'[i]}) {o}" for i, o in enumerate(opts)]
        return Instance(self, seed, "\n".join(lines), f"{letter}) {opts[order.index(0)]}",
                        options=opts, correct_letter=letter)


# --- loading --------------------------------------------------------------------------------

class BankError(ValueError):
    pass


def _load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@functools.lru_cache(maxsize=1)
def section_aliases() -> dict[str, str]:
    """Short names for lecture sections (bank/sections.yaml), so that relinking a topic to a new
    chapter is a one-line change."""
    return dict(_load_yaml(BANK_DIR / "sections.yaml"))


@functools.lru_cache(maxsize=1)
def topics() -> dict[str, str]:
    """Topic name -> what it covers (bank/topics.yaml)."""
    return dict(_load_yaml(BANK_DIR / "topics.yaml"))


def _point(p) -> dict:
    """A key point: {"says": ..., "any": [regex, ...]} or the short form "says :: rx1 | rx2"."""
    if isinstance(p, str):
        says, _, alts = p.partition(" :: ")
        if not alts:
            raise BankError(f"key point {p!r} needs ' :: ' followed by accepted phrasings")
        return dict(says=says.strip(), any=tuple(a.strip() for a in alts.split(" | ")))
    return dict(says=p["says"], any=tuple(p["any"]))


def _question(entry: dict, source: str) -> Question:
    where = f"{source}: {entry.get('id', '<no id>')}"
    for key in ("id", "kind", "topic", "difficulty", "section"):
        if key not in entry:
            raise BankError(f"{where}: missing '{key}'")
    qid, kind, topic = entry["id"], entry["kind"], entry["topic"]
    if not _ID.match(str(qid)):
        raise BankError(f"{where}: id must be lower-case letters, digits, '.', '_' or '-'")
    if kind not in KINDS:
        raise BankError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if topic not in topics():
        raise BankError(f"{where}: topic {topic!r} is not in topics.yaml")
    if entry["difficulty"] not in DIFFICULTIES:
        raise BankError(f"{where}: difficulty must be 1, 2 or 3")
    aliases = section_aliases()
    refs = entry["section"] if isinstance(entry["section"], list) else [entry["section"]]
    section = tuple(aliases.get(r, r) for r in refs)
    for ref in section:
        if not _SECTION.match(ref):
            raise BankError(f"{where}: section {ref!r} is neither an alias in sections.yaml nor "
                            "'notebooks/NN_name.ipynb#Heading'")
    kw = dict(id=qid, kind=kind, topic=topic, difficulty=entry["difficulty"], section=section,
              source_file=source, fact=entry.get("fact", ""),
              not_taught=entry.get("not_taught", ""))
    if kind == "concept":
        points = tuple(_point(p) for p in entry.get("points", ()))
        if not entry.get("prompt") or not entry.get("answer") or not points:
            raise BankError(f"{where}: a concept question needs prompt, answer and points")
        wrong = tuple(_point(p) for p in entry.get("wrong", ()))
        for p in points + wrong:
            for rx in p["any"]:
                re.compile(rx)
        kw.update(prompt=entry["prompt"], answer=entry["answer"], points=points, wrong=wrong)
    elif kind == "numeric":
        gen = entry.get("generator")
        if gen not in generators.GENERATORS:
            raise BankError(f"{where}: unknown generator {gen!r}")
        kw.update(generator=gen, params=tuple(sorted((entry.get("params") or {}).items(),
                                                      key=lambda kv: kv[0])))
        kw["params"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in kw["params"])
    else:
        opts = tuple(entry.get("options") or ())
        if len(opts) < 2 or not entry.get("prompt"):
            raise BankError(f"{where}: a {kind} question needs a prompt and >= 2 options "
                            "(the first is the right one)")
        if kind == "spot_the_error" and not entry.get("fact"):
            raise BankError(f"{where}: a spot_the_error item needs the correct fact")
        metrics = tuple(tuple(m) for m in entry.get("metrics") or ())
        if kind == "scenario" and not metrics:
            raise BankError(f"{where}: a scenario needs metrics: [[name, low, high, unit], ...]")
        kw.update(prompt=entry["prompt"], options=opts, metrics=metrics)
    return Question(**kw)


@functools.lru_cache(maxsize=4)
def _load(bank_dir: str) -> tuple:
    questions, seen = [], {}
    for path in sorted(Path(bank_dir).glob("q_*.yaml")):
        for entry in _load_yaml(path) or []:
            q = _question(entry, path.name)
            if q.id in seen:
                raise BankError(f"duplicate id {q.id!r} in {path.name} and {seen[q.id]}")
            seen[q.id] = path.name
            questions.append(q)
    return tuple(questions)


def load_bank(topic=None, kind=None, bank_dir=None) -> list[Question]:
    """Every question of the bank, optionally only those of one topic and/or kind.

    Unknown topic or kind names raise ValueError listing the known ones."""
    qs = list(_load(str(bank_dir or BANK_DIR)))
    if topic is not None:
        wanted = [topic] if isinstance(topic, str) else list(topic)
        for t in wanted:
            if t not in topics():
                raise ValueError(f"unknown topic {t!r}; use one of: {', '.join(topics())}")
        qs = [q for q in qs if q.topic in wanted]
    if kind is not None:
        wanted = [kind] if isinstance(kind, str) else list(kind)
        for k in wanted:
            if k not in KINDS:
                raise ValueError(f"unknown kind {k!r}; use one of: {', '.join(KINDS)}")
        qs = [q for q in qs if q.kind in wanted]
    return qs


def get(question_id: str) -> Question:
    for q in load_bank():
        if q.id == question_id:
            return q
    raise ValueError(f"no question with id {question_id!r}")
