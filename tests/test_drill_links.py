"""Every section a drill question links to teaches its answer, or the question says it is not
taught in this course yet and cites a public source (issue 18).

"Teaches" is checked the way a reader would first check it: the linked section (its heading down
to the next heading of the same or a higher level: prose, code and committed outputs) must use a
fair share of the question's key terms (words of four letters or more from its prompt, model
answer or fact, and key points). A section about something else shares few of them: before the
relink, 62 of 453 links fell under the bar, among them the capacity planner (01 s9) given for
parallelism and quantization and 08 s1 given for disaggregation.
"""
import json
import re
from functools import lru_cache
from pathlib import Path

from minillm.drill.bank import load_bank

ROOT = Path(__file__).resolve().parents[1]
MIN_SHARE = 0.2            # of the question's key terms found in the section
STOP = set("""about above after again against along also although always among another answer
answers asked because before being below between both cannot could does doing down during each
either enough every first from further give gives given have having here itself just last less
like made make makes many more most much must need needs never only other others over same
several should since some such than that their them then there these they this those through
under until very what when where which while will with within without would your yours into
onto once one two three four five""".split())


def key_terms(q) -> set:
    text = " ".join([q.prompt, q.answer, q.fact] + [p["says"] for p in q.points])
    if q.kind == "numeric":
        text = q.generator.replace("_", " ") + " " + " ".join(map(str, q.params))
    return {w for w in re.findall(r"[a-z][a-z0-9_\-]{3,}", text.lower()) if w not in STOP}


@lru_cache(maxsize=None)
def _cells(path: str):
    return json.loads((ROOT / path).read_text())["cells"]


def section_text(ref: str) -> str:
    path, heading = ref.split("#", 1)
    out, level = [], None
    for cell in _cells(path):
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for line in src.splitlines():
                m = re.match(r"^(#{1,6})\s+(.*\S)\s*$", line)
                if m and level is not None and len(m.group(1)) <= level:
                    return "\n".join(out).lower()
                if m and level is None and m.group(2) == heading:
                    level = len(m.group(1))
                if level is not None:
                    out.append(line)
        elif level is not None:
            out.append(src)
            for o in cell.get("outputs", []):
                out.append("".join(o.get("text") or o.get("data", {}).get("text/plain") or ""))
    assert level is not None, f"{ref}: no such heading"
    return "\n".join(out).lower()


def shared_terms(q, ref) -> tuple:
    text = section_text(ref)
    terms = key_terms(q)
    return {t for t in terms if t[:6] in text}, terms


def test_every_link_shares_the_question_key_terms():
    bad = []
    for q in load_bank():
        if q.not_taught:
            continue
        for ref in q.section:
            hit, terms = shared_terms(q, ref)
            if len(hit) < max(1, MIN_SHARE * len(terms)):
                bad.append(f"{q.id} -> {ref}: {len(hit)}/{len(terms)} key terms")
    assert not bad, "\n".join(bad)


def test_not_taught_questions_cite_a_public_source_and_say_so():
    marked = [q for q in load_bank() if q.not_taught]
    assert marked
    for q in marked:
        assert "http" in q.not_taught, q.id
        assert q.see_also().startswith("Not taught in this course yet"), q.id


def test_the_measure_can_fail():
    q = next(q for q in load_bank() if q.id == "tp.just-add-gpus")
    hit, terms = shared_terms(q, "notebooks/01_kv_cache_math.ipynb#9. The capacity planner")
    assert len(hit) < MIN_SHARE * len(terms)      # the old placeholder link for parallelism
