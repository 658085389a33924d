"""ipywidgets front-ends for the notebook: flashcards and an answer box with instant grading."""
from __future__ import annotations

import ipywidgets as W


def flashcards(questions, seed=0) -> W.VBox:
    """Cards one at a time: the prompt, then 'Show answer' reveals the model answer and the
    lecture sections; 'Next' moves on."""
    state = {"i": 0}
    out = W.Output(layout=W.Layout(border="1px solid #ccc", padding="8px"))
    show, nxt = W.Button(description="Show answer"), W.Button(description="Next")
    counter = W.Label()

    def render(reveal=False):
        q = questions[state["i"] % len(questions)]
        inst = q.instance(seed)
        counter.value = (f"card {state['i'] % len(questions) + 1} / {len(questions)} · "
                         f"{q.topic} · {q.id}")
        out.clear_output()
        with out:
            print(inst.prompt)
            if reveal:
                print("\n" + "-" * 60 + f"\n{inst.answer}\n\n{q.see_also()}")

    show.on_click(lambda _: render(True))

    def advance(_):
        state["i"] += 1
        render(False)
    nxt.on_click(advance)
    render(False)
    return W.VBox([counter, out, W.HBox([show, nxt])])


def answer_box(question, seed=0) -> W.VBox:
    """One question with a text box; 'Check' grades the answer and prints the feedback."""
    inst = question.instance(seed)
    prompt = W.Output()
    with prompt:
        print(inst.prompt)
    box = W.Text(placeholder="your answer, e.g. 320 KiB or B", layout=W.Layout(width="60%"))
    button, out = W.Button(description="Check"), W.Output()

    def check(_):
        out.clear_output()
        with out:
            print(inst.grade(box.value).feedback)
    button.on_click(check)
    box.on_submit(check)
    return W.VBox([prompt, W.HBox([box, button]), out])
