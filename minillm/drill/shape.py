"""Is a free-text answer an answer? Two checks the concept grader and the mock rubric share.

Key-point patterns find phrases, not understanding: "radix tree token-level LRU leaf prefix"
contains every phrase an answer about RadixAttention needs and explains nothing, and a page that
pastes everything the learner knows about the topic hits every point by volume. Both are capped
(at half marks for a concept question, at 2 of 5 for a mock phase), with the reason.

    salad_reason(text)               '' or why the text reads as a list of terms, not sentences
    overlong_reason(text, words)     '' or why the text is too long for the question
"""
from __future__ import annotations

import re

# Words that carry the grammar of a sentence. A written explanation is about 40% function
# words; a list of terms has almost none.
FUNCTION_WORDS = frozenset("""
a an the is are was were be been being it its this that these those there then than so
of to in on at by for from with without into onto over under about as per each every
and or but not no nor if when while because since until after before which who whom whose
what where why how does do did has have had can could will would should must may might
one all any some more most less only also just both either neither its their they them
we you he she his her our your i my me us him
""".split())

SALAD_MIN_WORDS = 5            # shorter answers are too short to judge
SALAD_FUNCTION_SHARE = 0.15    # below this share of function words: a list of terms
SALAD_FRAGMENT_WORDS = 3.0     # mean words per comma/semicolon/line fragment below this: a list
OVERLONG_FACTOR = 3.0          # more than this many times the model answer's words
OVERLONG_MIN_WORDS = 120       # ... and at least this many words


def words(text: str) -> list:
    return re.findall(r"[a-z0-9][a-z0-9'\-]*", str(text or "").lower())


def salad_reason(text: str, min_share: float = SALAD_FUNCTION_SHARE,
                 min_fragment_words: float = SALAD_FRAGMENT_WORDS) -> str:
    """'' when the text reads as sentences; else why it reads as a list of key terms.
    min_share: the share of function words under which it is a list (interview notes, which
    are terse by nature, are judged with a lower bar: mock.NOTES_FUNCTION_SHARE)."""
    ws = words(text)
    if len(ws) < SALAD_MIN_WORDS:
        return ""
    share = sum(w in FUNCTION_WORDS for w in ws) / len(ws)
    fragments = [f for f in re.split(r"[,;:\n/|]+|\.\s|\.$", str(text)) if words(f)]
    per_fragment = len(ws) / max(1, len(fragments))
    if share < min_share:
        return (f"it reads as a list of terms ({share:.0%} of its words are the small words "
                "that make sentences): say how the pieces connect, in sentences")
    if len(fragments) >= 4 and per_fragment < min_fragment_words:
        return (f"it reads as a list of terms ({len(fragments)} fragments of "
                f"{per_fragment:.1f} words on average): explain, in sentences")
    return ""


def overlong_reason(text: str, model_words: int) -> str:
    """'' unless the text is many times longer than the model answer (and long in itself)."""
    n = len(words(text))
    if n >= OVERLONG_MIN_WORDS and n > OVERLONG_FACTOR * model_words:
        return (f"it is {n} words, {n / max(1, model_words):.0f}x the model answer: an "
                "interviewer hears the key points, not everything you know; answer in a few "
                "sentences")
    return ""


__all__ = ["salad_reason", "overlong_reason", "words", "FUNCTION_WORDS"]
