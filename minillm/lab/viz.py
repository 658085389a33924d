"""Drawings and controls the lectures use, so that their cells read as experiments.

    draw_block_tables(mgr, ["A", "B"], {"A": "tab:blue", "B": "tab:orange"})   # chapter 03
    grid, prefills = slot_grid(run, slots=8)                                   # chapter 04
    plot_timelines([static_run, continuous_run], slots=8, title="...")
    step_through(describe, run_a, run_b)                                       # a widget
    controls(widgets.interactive(f, ...))                # a widget with a readable placeholder
    median_spread(samples) -> (median, low, high)                              # noisy timings
    memory_map_legend(ax)            # what solid, pale and white mean on a memory map (ch. 02-03)
    draw_free_queue(ax, title, queue, in_use, keyed, labels)    # chapter 06's LRU free queue

Nothing here imports the engine: the chapter 04 functions read the records of
`minillm.lab.step_trace.run_trace` (plain dicts), and the block-table drawing reads a
`BlockManager`. matplotlib and ipywidgets are imported when a function needs them.
"""
from __future__ import annotations

import statistics

import numpy as np


def draw_block_tables(mgr, seqs, colors, ax=None):
    """Logical blocks of each sequence -> its block table -> physical blocks of the pool.

    mgr: a `BlockManager`; seqs: the sequence ids to draw, top to bottom; colors: seq id ->
    matplotlib colour. Written slots are filled in proportion. Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    missing = [s for s in seqs if s not in mgr.tables]
    if missing:
        raise ValueError(f"sequences {missing} have no block table in this manager")
    bs, nb = mgr.block_size, mgr.pool.num_blocks
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
    ax.set_xlim(-0.2, 10.2)
    ax.set_ylim(-0.3, nb + 0.9)
    ax.axis("off")
    for x, title in ((1.2, "logical blocks\n(what the sequence sees)"), (4.6, "block table"),
                     (8.3, "physical blocks\n(the shared pool)")):
        ax.text(x, nb + 0.45, title, ha="center", va="center", fontsize=10, weight="bold")
    owner = {b: (s, i) for s in seqs for i, b in enumerate(mgr.block_table(s))}
    for b in range(nb):                                       # the pool, block 0 on top
        y = nb - 1 - b
        ax.add_patch(Rectangle((7.1, y + 0.1), 2.4, 0.8, fill=False, lw=1))
        text = f"block {b}: free"
        if b in owner:
            s, i = owner[b]
            written = min(bs, mgr.num_tokens(s) - i * bs)
            ax.add_patch(Rectangle((7.1, y + 0.1), 2.4 * written / bs, 0.8, color=colors[s],
                                   alpha=0.55))
            text = f"block {b}: {s} tokens {i * bs}-{i * bs + written - 1}"
        ax.text(7.2, y + 0.5, text, va="center", fontsize=8.5)
    y = nb - 1
    for s in seqs:                                            # sequences, top to bottom
        for i, b in enumerate(mgr.block_table(s)):
            written = min(bs, mgr.num_tokens(s) - i * bs)
            ax.add_patch(Rectangle((0, y + 0.1), 2.4, 0.8, fill=False, lw=1))
            ax.add_patch(Rectangle((0, y + 0.1), 2.4 * written / bs, 0.8, color=colors[s],
                                   alpha=0.55))
            ax.text(0.1, y + 0.5, f"{s}[{i}]: tokens {i * bs}-{i * bs + written - 1}", va="center",
                    fontsize=8.5)
            ax.add_patch(Rectangle((4.0, y + 0.1), 1.2, 0.8, fill=False, lw=1))
            ax.text(4.1, y + 0.5, f"[{i}]", va="center", fontsize=8, color="gray")
            ax.text(4.8, y + 0.5, str(b), ha="center", va="center", fontsize=11, weight="bold")
            ax.annotate("", xy=(4.0, y + 0.5), xytext=(2.4, y + 0.5),
                        arrowprops=dict(arrowstyle="->", color="gray"))
            ax.annotate("", xy=(7.1, nb - 1 - b + 0.5), xytext=(5.2, y + 0.5),
                        arrowprops=dict(arrowstyle="->", color=colors[s], lw=1.5,
                                        connectionstyle="arc3,rad=0.1"))
            y -= 1
        y -= 0.5
    return ax


def draw_free_queue(ax, title, queue, in_use, keyed, labels):
    """One row: the free queue (head first; blue = holds a cached prefix, grey = no key), a gap,
    then the blocks in use (orange). labels: block id -> name, taken when the snapshot was taken
    (a block handed to a later request is renamed; a drawing must not read the new name)."""
    import matplotlib.pyplot as plt
    boxes = [(b, "#9ecae1" if b in keyed else "#dddddd") for b in queue]
    boxes += [(None, None)] + [(b, "#fdae6b") for b in sorted(in_use)]
    for x, (b, color) in enumerate(boxes):
        if b is not None:
            ax.add_patch(plt.Rectangle((x, 0), 0.9, 0.9, color=color))
            ax.text(x + 0.45, 0.45, f"{labels.get(b, '-')}\n#{b}", ha="center", va="center",
                    fontsize=8)
    caption = "free queue, head (taken next) at the left" + (" | in use" if in_use else "")
    ax.set_title(f"{title}    [{caption}]", fontsize=8, loc="left")
    ax.set_xlim(-0.2, len(boxes) + 0.2)
    ax.set_ylim(-0.05, 0.95)
    ax.axis("off")
    return ax


def memory_map_legend(ax, **legend_kw):
    """Legend for `minillm.lab.memory_sim.plot_memory_map`: solid = written, pale = held but not
    written, white = free (drawn in one example colour; every request has its own)."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch
    solid = np.array(to_rgb("tab:blue"))
    pale = 1 - 0.3 * (1 - solid)                 # the same blend plot_memory_map uses
    handles = [Patch(color=solid, label="written (a colour per request)"),
               Patch(color=pale, label="held, not written"),
               Patch(facecolor="white", edgecolor="0.6", label="free")]
    kw = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False) | legend_kw
    return ax.legend(handles=handles, **kw)


def slot_grid(run, slots: int):
    """[slots, steps] grid of request numbers (-1: empty slot) and the (step, slot) prefill cells.

    A request keeps the lowest free slot from the step it is first scheduled until a step that
    does not schedule it (it finished or was preempted). Request ids are "r<number>"."""
    grid = np.full((slots, len(run.steps)), -1)
    seat, prefills = {}, []
    for rec in run.steps:
        k, active = rec["step"], rec["scheduled"]
        if len(active) > slots:
            raise ValueError(f"step {k} scheduled {len(active)} requests but there are "
                             f"{slots} slots")
        for rid in [rid for rid in seat if rid not in active]:     # left: finished or preempted
            del seat[rid]
        free = sorted(set(range(slots)) - set(seat.values()))
        for rid in sorted(active, key=lambda rid: int(rid[1:])):
            if rid not in seat:
                seat[rid] = free.pop(0)
        for rid, slot in seat.items():
            grid[slot, k] = int(rid[1:])
            if rid in rec["prefill"]:
                prefills.append((k, slot))
    return grid, prefills


def plot_timelines(runs, slots: int, title: str):
    """One slot timeline per run (colour = request, tick = prefill) above its waiting queue."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    colours = ListedColormap(plt.get_cmap("tab20").colors).with_extremes(bad="white")
    n = len(runs)
    most_waiting = max(len(rec["waiting"]) for run in runs for rec in run.steps)
    fig, axes = plt.subplots(2 * n, 1, figsize=(11, 2.6 * n + 1), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": [3, 1] * n})
    for i, run in enumerate(runs):
        grid, prefills = slot_grid(run, slots)
        shown = np.ma.masked_where(grid < 0, grid % 20)
        ax = axes[2 * i]
        ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=colours, vmin=0, vmax=20,
                  origin="lower", extent=(-0.5, grid.shape[1] - 0.5, -0.5, slots - 0.5))
        if prefills:
            ax.scatter(*zip(*prefills), marker="|", s=40, color="black", linewidths=1)
        ax.set_title(f"{run.name}: {len(run.steps)} steps, {(grid < 0).sum():,} idle slot-steps",
                     fontsize=10)
        ax.set_ylabel("batch slot")
        ax.set_yticks(range(slots))
        q = axes[2 * i + 1]
        q.fill_between(range(len(run.steps)), [len(rec["waiting"]) for rec in run.steps],
                       step="mid", color="tab:gray")
        q.set_ylabel("waiting")
        q.set_ylim(0, most_waiting + 1)
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    return fig


def step_through(describe, *runs):
    """A run picker and a step slider over recorded runs; the panel prints describe(run, step).

    Returns the controls (display them, or let them be a cell's last value)."""
    import ipywidgets as widgets
    if not runs:
        raise ValueError("step_through needs at least one recorded run")
    pick = widgets.Dropdown(options=[(r.name, i) for i, r in enumerate(runs)], description="run")
    slider = widgets.IntSlider(value=0, min=0, max=len(runs[0].steps) - 1, description="step",
                               continuous_update=True, layout=widgets.Layout(width="60%"))
    play = widgets.Play(interval=300, min=0, max=slider.max)
    widgets.jslink((play, "value"), (slider, "value"))
    panel = widgets.Output(layout=widgets.Layout(font_family="monospace"))

    def show(_=None):
        run = runs[pick.value]
        slider.max = play.max = len(run.steps) - 1
        with panel:
            panel.clear_output(wait=True)
            print(describe(run, slider.value))

    pick.observe(show, "value")
    slider.observe(show, "value")
    show()
    return controls(widgets.VBox([widgets.HBox([pick, play, slider]), panel]))


PLACEHOLDER = "[controls] Run the cells above, then this one, to get the controls."


class controls:
    """A widget whose saved output says how to get it back.

    A notebook stores a widget's output as a reference to a live widget plus a plain-text
    stand-in. On a fresh open there is no live widget, and the stand-in is what the reader sees:
    by default `VBox(children=(...` ; with this wrapper, a sentence that says what to do.
    """

    def __init__(self, widget):
        self.widget = widget

    def _repr_mimebundle_(self, **kwargs):
        data = self.widget._repr_mimebundle_(**kwargs)
        data["text/plain"] = PLACEHOLDER
        return data


def median_spread(samples):
    """(median, min, max) of repeated measurements: plot the median, show the spread as a bar."""
    samples = list(samples)
    if not samples:
        raise ValueError("median_spread needs at least one measurement")
    return statistics.median(samples), min(samples), max(samples)
