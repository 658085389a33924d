"""Chapter 10 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: a column split along the
wrong axis, a missing all-reduce, the bias added on every rank, one all-reduce per layer, the
ring factor forgotten or halved, the bubble without the fill slots or inverted, tensor
parallelism stretched across nodes, a tp that does not divide the heads."""
import torch
import torch.nn.functional as F

from minillm.grading import ch10, grade

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "10_parallelism.ipynb"
GRADED = {
    "parallel_linear": ch10.LINEAR,
    "all_reduce_cost": ch10.COST,
    "pipeline_bubble": ch10.BUBBLE,
    "choose_parallelism": ch10.CHOOSE,
}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert [e.id for e in ch10.EXERCISES] == ["ch10.parallel_linear", "ch10.all_reduce_cost",
                                             "ch10.pipeline_bubble", "ch10.choose_parallelism"]


# ------------------------------------------------------------------ planted bugs
def _linear(split_k_for_column=False, no_all_reduce=False, bias_every_rank=False):
    def parallel_linear(x, w, b, world_size, mode):
        N, K = w.shape
        if mode not in ("column", "row") or (mode == "column" and N % world_size) or (
                mode == "row" and K % world_size):
            raise ValueError("bad")
        if mode == "column" and not split_k_for_column:
            n = N // world_size
            parts = [F.linear(x, w[r * n:(r + 1) * n], None if b is None else b[r * n:(r + 1) * n])
                     for r in range(world_size)]
            return parts, torch.cat(parts, -1)
        k = K // world_size
        parts = [F.linear(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k],
                          b if (bias_every_rank and b is not None) else None)
                 for r in range(world_size)]
        y = parts[0] if no_all_reduce else torch.stack(parts).sum(0)
        if b is not None and not bias_every_rank:
            y = y + b
        return parts, y
    return parallel_linear


linear_wrong_axis = _linear(split_k_for_column=True)
linear_wrong_axis.__name__ = "linear_wrong_axis"
linear_no_all_reduce = _linear(no_all_reduce=True)
linear_no_all_reduce.__name__ = "linear_no_all_reduce"
linear_bias_every_rank = _linear(bias_every_rank=True)
linear_bias_every_rank.__name__ = "linear_bias_every_rank"


def _cost(per_layer=2, ring=lambda tp: 2 * (tp - 1) / tp):
    def all_reduce_cost(hidden, num_layers, tokens, dtype_bytes, tp, bandwidth):
        if min(hidden, num_layers, tokens, dtype_bytes, tp) < 1 or bandwidth <= 0:
            raise ValueError("bad")
        payload = per_layer * num_layers * tokens * hidden * dtype_bytes
        wire = payload * ring(tp)
        return {"payload_bytes": payload, "wire_bytes": wire, "seconds": wire / bandwidth}
    return all_reduce_cost


cost_one_per_layer = _cost(per_layer=1)
cost_one_per_layer.__name__ = "cost_one_per_layer"
cost_no_ring = _cost(ring=lambda tp: 1.0)
cost_no_ring.__name__ = "cost_no_ring"
cost_half_ring = _cost(ring=lambda tp: (tp - 1) / tp)
cost_half_ring.__name__ = "cost_half_ring"


def _bubble(formula):
    def pipeline_bubble(p, m):
        if p < 1 or m < 1:
            raise ValueError("bad")
        return formula(p, m)
    return pipeline_bubble


bubble_no_fill = _bubble(lambda p, m: (p - 1) / m)
bubble_no_fill.__name__ = "bubble_no_fill"
bubble_busy = _bubble(lambda p, m: m / (m + p - 1))
bubble_busy.__name__ = "bubble_busy"


def _choose(across_nodes=False, ignore_heads=False):
    def choose_parallelism(model_bytes, num_heads, gpu_bytes, gpus_per_node, num_nodes):
        if min(num_heads, gpus_per_node, num_nodes) < 1 or model_bytes <= 0:
            raise ValueError("bad")
        limit = gpus_per_node * (num_nodes if across_nodes else 1)
        tps = [t for t in range(1, limit + 1) if ignore_heads or num_heads % t == 0]
        for tp in tps:
            if model_bytes / tp <= gpu_bytes:
                return tp, 1
        tp = tps[-1]
        for pp in range(2, num_nodes + 1):
            if model_bytes / (tp * pp) <= gpu_bytes:
                return tp, pp
        raise ValueError("does not fit")
    return choose_parallelism


choose_tp_across_nodes = _choose(across_nodes=True)
choose_tp_across_nodes.__name__ = "choose_tp_across_nodes"
choose_ignores_heads = _choose(ignore_heads=True)
choose_ignores_heads.__name__ = "choose_ignores_heads"

BUGS = [
    ("parallel_linear", linear_wrong_axis, "N / world_size", "splits the INPUT dimension"),
    ("parallel_linear", linear_no_all_reduce, "all-reduce recombines", "all-reduce (the sum"),
    ("parallel_linear", linear_bias_every_rank, "bias not on every rank", "bias added on every"),
    ("all_reduce_cost", cost_one_per_layer, "payload", "two (after o_proj"),
    ("all_reduce_cost", cost_no_ring, "wire bytes", "that is the payload"),
    ("all_reduce_cost", cost_half_ring, "wire bytes", "reduce-scatter AND all-gather"),
    ("pipeline_bubble", bubble_no_fill, "(p - 1) / (m + p - 1)", "fill and drain"),
    ("pipeline_bubble", bubble_busy, "(p - 1) / (m + p - 1)", "busy share"),
    ("choose_parallelism", choose_tp_across_nodes, "across nodes", "tp spans nodes"),
    ("choose_parallelism", choose_ignores_heads, "divides the heads", "does not divide"),
]
(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_a_function_that_raises_is_reported():
    def broken(*args):
        raise IndexError("oops")
    result = grade(ch10.BUBBLE, broken, time_limit=30)
    assert result.score == 0 and "IndexError" in result.messages[0]
