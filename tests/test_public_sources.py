"""Learners never see the documents the course was planned from, so nothing they read may cite them.

Every notebook (lectures, solutions, exercises) and the README is searched, sources and outputs,
with line breaks folded, for the ways such references were written: document ids and question
numbers ("(003, Q2)", "003 Q7"), "the seed" as a document, "the interview guides / question banks
this course draws on", "source material", the planning files' names. A wrong claim is "a common
claim", settled by a measurement or a public source (a paper, documentation).
"""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each pattern is one way a planning document has been cited; case-insensitive, whitespace folded.
PATTERNS = [
    r"\(\s*00\d\s*,\s*Q\d",                                    # (003, Q2)
    r"\b00\d[ _-]?[A-Z]?Q\d",                                  # 003 Q7, 002-Q36, 001_Q5
    r"\b00\d[ _-][A-Z]\d{1,2}\b",                              # 001-T2, 004-M4, 001 W12
    r"\b00\d,? (?:question|item|follow-up)",
    r"\bclaims? in the seeds?\b",
    r"\bcorrecting (?:a|the) seeds?\b",
    r"\b(?:a|the|one|this) seed (?:says|claims|writes|puts|document|guide)",
    r"\bseed (?:documents?|guides?|material|questions?)\b",
    r"\bin the seeds?\b(?! *(?:=|argument|value|of the|for the|generator))",
    r"\bfrom the seeds?\b(?! *(?:=|argument|value|of the|for the|generator))",
    r"\b(?:interview|question|answer)[ -]"
    r"(?:documents?|guides?|banks?|answer guides?|questions?|material)"
    r"(?: and \w+)? (?:that )?(?:this|the) course (?:draws|drew|is drawn|is based|builds)",
    r"\b(?:this|the) course (?:draws|drew) on\b",
    r"\binterview (?:documents?|guides?) (?:this|the) course\b",
    r"\bthe interview material\b",
    r"\b(?:one|the same|another|this) (?:interview |answer )?guide "
    r"(?:says|writes|claims|puts|multiplies|quotes|gets)",
    r"\binterview guides (?:quote|say|claim|put)",
    r"\bsource material\b",
    r"\bplanning (?:documents?|material)\b",
    r"\bseeds/",
    r"\bcoverage-[\w-]*\.md\b",
    r"\berrors-found\b",
]
REGEX = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)


def _texts(path: Path):
    """(where, text) pieces of a notebook (cell sources and text outputs) or a text file."""
    if path.suffix != ".ipynb":
        yield path.name, path.read_text(encoding="utf-8")
        return
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        yield f"{path.parent.name}/{path.name} cell {i}", cell.source
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            text = text if isinstance(text, str) else "".join(text)
            yield f"{path.parent.name}/{path.name} cell {i} output", text


def _files():
    files = [ROOT / "README.md"]
    for folder in ("notebooks", "solutions", "exercises"):
        files += sorted((ROOT / folder).glob("*.ipynb"))
    return [f for f in files if f.exists()]


def find_references(text: str) -> list:
    return [m.group(0) for m in REGEX.finditer(" ".join(text.split()))]


@pytest.mark.parametrize("path", _files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_learner_files_cite_only_public_sources(path):
    found = [f"{where}: {hit!r}" for where, text in _texts(path) for hit in find_references(text)]
    assert not found, ("these cite the course's planning documents, which learners never see; say "
                       "'a common claim' and settle it with a measurement or a public source:\n"
                       + "\n".join(found))


def test_the_course_has_files_to_check():
    names = {p.parent.name for p in _files()}
    assert {"notebooks", "solutions", "exercises"} <= names and len(_files()) >= 13


CITED = [   # how lectures cited the planning documents before they were rewritten
    "One of the interview answer guides this course draws on (003, Q2) says vLLM pads",
    "**Correcting a seed: who gets preempted?** The same interview guide (003, Q7 and a follow-up",
    "| claim in the seed | what is true |",
    "| 003 Q5: TGI uses static batching by default |",
    "One of the interview documents this course draws on says the opposite",
    "A correction to an interview answer. One of the question banks this course draws on claims",
    "A question bank this course draws on puts paging metadata at",
    "| two of the interview guides this course draws on | ~5 % |",
    "correct three claims of the interview questions this course draws on: which request",
    "**Two corrections to interview answers** this course draws on:",
    "The source material for this course contains several wrong KV numbers.",
    "as the speculative item 001-T2 puts it",
    "the seed says acceptance depends on KL divergence",
    "Three corrections to the interview material:",
    "see seeds/errors-found.md",
    "a topic of coverage-interview.md",
    "One guide writes \"K vector: [num_heads x head_dim]\" and gets 512 KB/token",
    "The same guide multiplies \"320 KB\" by decimal factors",
    "Interview guides quote a handful of KV numbers.",
]
PUBLIC = [   # ordinary text about random seeds and public sources must pass
    "drawn by the same generator with the same arguments and seed: 200 requests",
    "torch.manual_seed(0); make_workload(seed=0); seeded random token ids",
    "A common claim says the opposite (Pope et al., 2022).",
    "Poisson arrivals, seeded. Change the seed and the trace changes.",
    "the PagedAttention paper (Kwon et al., SOSP 2023, §7.1)",
    "in the seed argument of make_workload",
    "Llama-3-8B has 32 layers; the 003 runs of the benchmark",
    "a study guide to the kernels; the guide to JupyterLab says",
]


@pytest.mark.parametrize("text", CITED)
def test_pattern_catches_a_citation(text):
    assert find_references(text), text


@pytest.mark.parametrize("text", PUBLIC)
def test_pattern_leaves_ordinary_text_alone(text):
    assert not find_references(text), find_references(text)
