"""The terminal quiz and the spaced-repetition review, with input and output passed in
(so tests drive them with scripted answers and a fake clock)."""
from __future__ import annotations

import random
import zlib
from collections import defaultdict
from datetime import datetime, timezone
from typing import Callable

from .bank import Question, overlong
from .state import Progress, drill_dir, load_json, save_json
from .units import DIMENSION_WORDS

QUIT = {"q", "quit", "exit"}


def _hint(inst) -> str:
    q = inst.question
    if q.kind == "numeric":
        return f"(answer with {DIMENSION_WORDS[inst.dimension]})"
    if q.kind == "concept":
        return "(answer in a sentence or two on one line)"
    return "(answer with a letter)"


def ask(inst, index: int, total: int, input_fn: Callable, output_fn: Callable):
    """Show one instance, read one answer; returns the Grade, or None when the user quits."""
    q = inst.question
    output_fn(f"\n[{index}/{total}] {q.kind} · {q.topic} · difficulty {q.difficulty} · {q.id}")
    output_fn(inst.prompt)
    prompt = f"{_hint(inst)}\n> "
    for _ in range(3):                           # an overlong answer is refused, not graded
        try:
            response = input_fn(prompt)
        except EOFError:
            return None
        if response.strip().lower() in QUIT:
            return None
        too_long = overlong(response)
        if not too_long:
            break
        output_fn(f"That answer is too long to grade: {too_long}")
        prompt = "> "
    grade = inst.grade(response)
    output_fn(grade.feedback)
    return grade


def select(questions: list[Question], n: int, seed) -> list[Question]:
    if n < 1:
        raise ValueError(f"--n must be at least 1, got {n}")
    if not questions:
        raise ValueError("no question matches the chosen topic and kind")
    qs = list(questions)
    random.Random(f"quiz:{seed}").shuffle(qs)
    return qs[:n]


def run_quiz(questions: list[Question], n: int = 10, seed=0, input_fn: Callable = input,
             output_fn: Callable = print, progress: Progress = None) -> dict:
    """Ask n questions (a seeded draw), grade each, print a summary; returns the scores by id."""
    chosen = select(questions, n, seed)
    scores, by_topic = {}, defaultdict(list)
    for i, q in enumerate(chosen, 1):
        inst = q.instance(seed)
        grade = ask(inst, i, len(chosen), input_fn, output_fn)
        if grade is None:
            output_fn("\nStopped early.")
            break
        scores[q.id] = grade.score
        by_topic[q.topic].append(grade.score)
        if progress is not None:
            progress.record(q.id, grade.score, seed)
    total = sum(scores.values())
    output_fn(f"\nScore: {total:.2f} / {len(scores)}"
              + (f" ({total / len(scores):.0%})" if scores else ""))
    for topic, s in sorted(by_topic.items()):
        output_fn(f"  {topic}: {sum(s):.2f} / {len(s)}")
    if progress is not None:
        progress.save()
        output_fn(f"Progress saved to {progress.path}")
    return scores


# --- spaced repetition ------------------------------------------------------------------------

def rating_for(score: float):
    """FSRS rating from a score: full marks Good, at least half Hard, less Again."""
    from fsrs import Rating
    if score >= 0.999:
        return Rating.Good
    if score >= 0.5:
        return Rating.Hard
    return Rating.Again


def check_cards(cards: dict) -> None:
    """Raise ValueError unless every value is a card FSRS can schedule: Card.from_dict accepts it,
    its dates carry a time zone (they are compared with an aware 'now'), and a card past its
    learning steps has a stability and a difficulty."""
    from fsrs import Card, State
    for qid, d in cards.items():
        if not isinstance(d, dict):
            raise ValueError(f"the card of {qid!r} is a {type(d).__name__}, not an object")
        try:
            card = Card.from_dict(d)
        except KeyError as exc:
            raise ValueError(f"the card of {qid!r} has no {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the card of {qid!r} is not an FSRS card ({exc})") from None
        if card.due.tzinfo is None or (card.last_review and card.last_review.tzinfo is None):
            raise ValueError(f"the card of {qid!r} has a date without a time zone")
        if card.state == State.Review and (card.stability is None or card.difficulty is None):
            raise ValueError(f"the card of {qid!r} is in review without stability/difficulty")
        if card.state != State.Review and not isinstance(card.step, int):
            raise ValueError(f"the card of {qid!r} is learning without a step")


class ReviewState:
    """FSRS cards by question id, kept in review.json in the drill directory. A file of the wrong
    shape (see check_cards) is set aside like corrupt JSON (state.load_json)."""

    def __init__(self, path=None, warn=None):
        self.path = path or drill_dir() / "review.json"
        self.cards = load_json(self.path, {}, warn, check_cards)

    def card(self, qid: str):
        from fsrs import Card
        if qid in self.cards:
            return Card.from_dict(self.cards[qid])
        return Card(card_id=zlib.crc32(qid.encode()))

    def put(self, qid: str, card) -> None:
        self.cards[qid] = card.to_dict()

    def save(self) -> None:
        save_json(self.path, self.cards)


def due_questions(questions: list[Question], state: ReviewState, now: datetime, new: int,
                  seed=0) -> list[Question]:
    """Questions due for review (oldest due first), then up to `new` never-seen ones."""
    due = []
    for q in questions:
        if q.id in state.cards:
            card = state.card(q.id)
            if card.due <= now:
                due.append((card.due, q))
    due.sort(key=lambda t: t[0])
    unseen = [q for q in questions if q.id not in state.cards]
    random.Random(f"review:{seed}").shuffle(unseen)
    return [q for _, q in due] + unseen[:max(0, new)]


def run_review(questions: list[Question], n: int = 20, new: int = 10, seed=0,
               input_fn: Callable = input, output_fn: Callable = print, state: ReviewState = None,
               now: Callable = lambda: datetime.now(timezone.utc)) -> dict:
    """A review session: due cards first, then new ones; each answer updates its FSRS card."""
    from fsrs import Scheduler
    state = state or ReviewState()
    scheduler = Scheduler(enable_fuzzing=False)
    queue = due_questions(questions, state, now(), new, seed)[:n]
    if not queue:
        output_fn("Nothing is due. Come back later, or raise --new to add unseen questions.")
        return {}
    scores = {}
    for i, q in enumerate(queue, 1):
        card = state.card(q.id)
        last = card.last_review.isoformat() if card.last_review else "new"
        inst = q.instance(f"review-{last}")          # fresh numbers on every review
        grade = ask(inst, i, len(queue), input_fn, output_fn)
        if grade is None:
            output_fn("\nStopped early.")
            break
        card, _ = scheduler.review_card(card, rating_for(grade.score), now())
        state.put(q.id, card)
        scores[q.id] = grade.score
        output_fn(f"next review: {card.due:%Y-%m-%d %H:%M} UTC")
    state.save()
    output_fn(f"\nReviewed {len(scores)}; review state saved to {state.path}")
    return scores
