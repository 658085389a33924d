"""Export the bank as an Anki deck (genanki). Note GUIDs come from the question ids, so
re-importing an updated export updates the existing cards instead of duplicating them."""
from __future__ import annotations

import html

import genanki

from .bank import load_bank

# fixed ids: Anki identifies the note type and the deck by them across exports
MODEL_ID = 1_702_406_312
DECK_ID = 1_702_406_313


def _model() -> genanki.Model:
    return genanki.Model(
        MODEL_ID, "minillm drill",
        fields=[{"name": "Id"}, {"name": "Question"}, {"name": "Answer"}, {"name": "Section"},
                {"name": "Topic"}],
        templates=[{
            "name": "Card 1",
            "qfmt": "<div class=topic>{{Topic}}</div>{{Question}}",
            "afmt": "{{FrontSide}}<hr id=answer>{{Answer}}<div class=section>{{Section}}</div>",
        }],
        css=".card{font-family:sans-serif;font-size:18px;text-align:left}"
            ".topic,.section{color:#777;font-size:13px}",
        sort_field_index=1)


def _html(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


def guid_for(qid: str) -> str:
    return genanki.guid_for("minillm-drill", qid)


def build_deck(questions=None, seed=0) -> genanki.Deck:
    deck = genanki.Deck(DECK_ID, "minillm interview drill")
    model = _model()
    for q in questions if questions is not None else load_bank():
        inst = q.instance(seed)
        answer = inst.answer
        if q.kind == "numeric":
            answer = f"{inst.answer}\n\nWorking: {inst._numeric.working}"
        elif q.kind != "concept" and q.fact:
            from .facts import render
            answer = f"{inst.answer}\n\n{render(q.fact)}"
        deck.add_note(genanki.Note(
            model=model, guid=guid_for(q.id),
            fields=[q.id, _html(inst.prompt), _html(answer), _html("; ".join(q.section)), q.topic],
            tags=[q.topic, q.kind, f"ch{q.chapter}"]))
    return deck


def export_anki(path, questions=None, seed=0) -> int:
    """Write an .apkg file; returns the number of notes."""
    deck = build_deck(questions, seed)
    genanki.Package(deck).write_to_file(str(path))
    return len(deck.notes)
