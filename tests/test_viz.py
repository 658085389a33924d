"""minillm.lab.viz: the drawings and controls the lectures use (headless: Agg backend)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minillm.cache.blocks import BlockManager  # noqa: E402
from minillm.lab import viz  # noqa: E402


class _Run:
    def __init__(self, name, steps):
        self.name, self.steps = name, steps


def _rec(step, scheduled, prefill=(), waiting=()):
    return dict(step=step, scheduled=dict(scheduled), prefill=set(prefill), waiting=list(waiting))


def test_slot_grid_keeps_seats_and_refills_the_lowest_free_slot():
    run = _Run("toy", [
        _rec(0, {"r0": 3, "r1": 2}, prefill=["r0", "r1"]),
        _rec(1, {"r0": 1, "r1": 1}, waiting=["r2"]),
        _rec(2, {"r1": 1, "r2": 4}, prefill=["r2"]),      # r0 left: r2 takes slot 0
        _rec(3, {}),                                        # idle step
    ])
    grid, prefills = viz.slot_grid(run, slots=3)
    assert grid.tolist() == [[0, 0, 2, -1], [1, 1, 1, -1], [-1, -1, -1, -1]]
    assert sorted(prefills) == [(0, 0), (0, 1), (2, 0)]
    with pytest.raises(ValueError, match="2 slots"):
        viz.slot_grid(_Run("full", [_rec(0, {"r0": 1, "r1": 1, "r2": 1})]), slots=2)


def test_plot_timelines_counts_idle_slot_steps():
    run = _Run("toy", [_rec(0, {"r0": 1}, waiting=["r1"]), _rec(1, {"r0": 1, "r1": 1})])
    fig = viz.plot_timelines([run, run], slots=2, title="t")
    assert len(fig.axes) == 4
    assert fig.axes[0].get_title() == "toy: 2 steps, 1 idle slot-steps"
    plt.close(fig)


def test_draw_block_tables_draws_one_arrow_pair_per_table_entry():
    mgr = BlockManager(num_blocks=6, block_size=4)
    mgr.allocate("A", 6)
    mgr.allocate("B", 3)
    ax = viz.draw_block_tables(mgr, ["A", "B"], {"A": "tab:blue", "B": "tab:orange"})
    texts = [t.get_text() for t in ax.texts]
    entries = len(mgr.block_table("A")) + len(mgr.block_table("B"))
    assert len(ax.patches) >= 6 + entries                    # pool boxes and table cells at least
    assert sum(t.startswith("block ") and t.endswith("free") for t in texts) == 6 - entries
    assert f"block {mgr.block_table('A')[1]}: A tokens 4-5" in texts
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="no block table"):
        viz.draw_block_tables(mgr, ["C"], {"C": "red"})


def test_controls_replace_the_raw_widget_text():
    widgets = pytest.importorskip("ipywidgets")
    box = viz.controls(widgets.VBox([widgets.IntSlider()]))
    data = box._repr_mimebundle_()
    assert data["text/plain"] == viz.PLACEHOLDER and "VBox" not in data["text/plain"]
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == box.widget.model_id


def test_step_through_shows_the_described_step():
    pytest.importorskip("ipywidgets")
    run = _Run("toy", [_rec(0, {"r0": 1}), _rec(1, {"r0": 1})])
    shown = []
    ctl = viz.step_through(lambda r, k: shown.append((r.name, k)) or f"{r.name} {k}", run)
    pick_play_slider, panel = ctl.widget.children
    slider = pick_play_slider.children[2]
    assert slider.max == 1 and shown[-1] == ("toy", 0)
    slider.value = 1
    assert shown[-1] == ("toy", 1)
    with pytest.raises(ValueError):
        viz.step_through(lambda r, k: "")


def test_median_spread():
    assert viz.median_spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    with pytest.raises(ValueError):
        viz.median_spread([])


def test_memory_map_legend_matches_the_map_colours():
    from minillm.lab.arena import ContiguousArena
    from minillm.lab.memory_sim import plot_memory_map, simulate_arena
    from minillm.lab.workloads import make_workload
    work = make_workload(mix="sharegpt", num_requests=4, seed=0, context_len=256, rate=50.0,
                         reserve="context")
    trace = simulate_arena(work.requests, ContiguousArena(512), map_every=1)
    ax = plot_memory_map(trace)
    legend = viz.memory_map_legend(ax)
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["written (a colour per request)", "held, not written", "free"]
    image = ax.get_images()[0].get_array()                  # [bins, snapshots, rgb]
    solid, pale = (np.array(p.get_facecolor()[:3]) for p in legend.get_patches()[:2])
    # request 0 is tab:blue in the map: both its written and its held-not-written colours appear
    colours = {tuple(np.round(c, 6)) for c in image.reshape(-1, 3)}
    assert tuple(np.round(solid, 6)) in colours and tuple(np.round(pale, 6)) in colours
    plt.close(ax.figure)
