"""Chapter 07 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: a residual not renormalised or
taken the wrong way round, a forgotten bonus token, the ratio p/q inverted, a sampler that draws
from p instead of the residual, off-by-one and first-instead-of-latest n-gram matches, a^k
instead of a^(k+1), the target's pass left out of the cost."""
import torch

from minillm.grading import ch07, grade

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "07_speculative_decoding.ipynb"
GRADED = {
    "residual_distribution": ch07.RESIDUAL,
    "rejection_sample": ch07.REJECTION,
    "ngram_propose": ch07.NGRAM,
    "expected_speedup": ch07.SPEEDUP,
    "tree_attention_mask": ch07.TREE_MASK,
}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert [e.id for e in ch07.EXERCISES] == ["ch07.residual", "ch07.rejection_sample",
                                             "ch07.ngram_propose", "ch07.expected_speedup",
                                             "ch07.tree_attention_mask"]


# ------------------------------------------------------------------ planted bugs
def residual_not_renormalised(p, q):
    return (p - q).clamp_min(0)


def residual_backwards(p, q):
    r = (q - p).clamp_min(0)
    return r / r.sum()


def _sampler(name, bonus=True, invert=False, from_p=False, raw_residual=False):
    def rs(target_probs, draft_token_ids, draft_probs=None, generator=None):
        k = len(draft_token_ids)
        out = []
        for i, d in enumerate(draft_token_ids):
            p = target_probs[i].double()
            q = torch.zeros_like(p) if draft_probs is None else draft_probs[i].double()
            if draft_probs is None:
                q[d] = 1.0
            ratio = (q[d] / p[d] if p[d] > 0 else 1.0) if invert else \
                (p[d] / q[d] if q[d] > 0 else 0.0)
            if float(torch.rand((), generator=generator)) < min(1.0, float(ratio)):
                out.append(int(d))
                continue
            if from_p:
                r = p
            else:
                r = (p - q).clamp_min(0)
                if raw_residual:                  # sampled by hand without renormalising
                    u = float(torch.rand((), generator=generator))
                    idx = int((r.cumsum(0) < u).sum())
                    return out + [min(idx, len(r) - 1)]
            out.append(int(torch.multinomial(r.float(), 1, generator=generator)))
            return out
        if bonus:
            out.append(int(torch.multinomial(target_probs[k].float(), 1, generator=generator)))
        return out
    rs.__name__ = name
    return rs


bonus_forgotten = _sampler("bonus_forgotten", bonus=False)
p_over_q_inverted = _sampler("p_over_q_inverted", invert=True)
resamples_from_p = _sampler("resamples_from_p", from_p=True)
residual_not_normalised_sampler = _sampler("residual_not_normalised", raw_residual=True)


def ngram_misses_adjacent(token_ids, k, lo, hi):        # off by one: start at N - n - 2
    ids, N = list(token_ids), len(token_ids)
    for n in range(min(hi, N - 1), lo - 1, -1):
        for start in range(N - n - 2, -1, -1):
            if ids[start:start + n] == ids[N - n:]:
                return ids[start + n:start + n + k]
    return []


def ngram_first_occurrence(token_ids, k, lo, hi):
    ids, N = list(token_ids), len(token_ids)
    for n in range(min(hi, N - 1), lo - 1, -1):
        for start in range(0, N - n):
            if ids[start:start + n] == ids[N - n:]:
                return ids[start + n:start + n + k]
    return []


def ngram_shortest_first(token_ids, k, lo, hi):
    ids, N = list(token_ids), len(token_ids)
    for n in range(lo, min(hi, N - 1) + 1):
        for start in range(N - n - 1, -1, -1):
            if ids[start:start + n] == ids[N - n:]:
                return ids[start + n:start + n + k]
    return []


def speedup_alpha_k(alpha, k, c):
    return (k if alpha == 1 else (1 - alpha ** k) / (1 - alpha)) / (k * c + 1)


def speedup_no_target_cost(alpha, k, c):
    t = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return t / max(k * c, 1e-12)


def mask_causal(parents):
    n = len(parents)
    return torch.ones(n, n).tril().bool()


def mask_parent_only(parents):
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i, p] = True
    return m


def mask_transposed(parents):
    from minillm.spec.tree import tree_mask
    return tree_mask(parents).T


def mask_without_self(parents):
    from minillm.spec.tree import tree_mask
    return tree_mask(parents) & ~torch.eye(len(parents), dtype=torch.bool)


BUGS = [
    ("residual_distribution", residual_not_renormalised, "sums to 1", "without renormalising"),
    ("residual_distribution", residual_backwards, "equals max", "where the TARGET wants more"),
    ("rejection_sample", bonus_forgotten, "bonus", "bonus token is missing"),
    ("rejection_sample", p_over_q_inverted, "min(1, p/q)", "target over draft"),
    ("rejection_sample", resamples_from_p, "chi-square", "must follow p[0]"),
    ("rejection_sample", residual_not_normalised_sampler, "chi-square", "must follow p[0]"),
    ("ngram_propose", ngram_misses_adjacent, "off-by-one", "right before the suffix"),
    ("ngram_propose", ngram_first_occurrence, "latest", "take the latest"),
    ("ngram_propose", ngram_shortest_first, "longest", "longest n that matches wins"),
    ("expected_speedup", speedup_alpha_k, "free draft", "a^(k+1)"),
    ("expected_speedup", speedup_no_target_cost, "k c + 1", "verification pass counts too"),
    ("tree_attention_mask", mask_causal, "siblings", "causal mask"),
    ("tree_attention_mask", mask_parent_only, "every ancestor", "is an ancestor of"),
    ("tree_attention_mask", mask_transposed, "chain", "QUERY node"),
    ("tree_attention_mask", mask_without_self, "chain", "must see itself"),
]
(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_a_sampler_that_raises_is_reported():
    def broken(*a, **kw):
        raise IndexError("oops")
    result = grade(ch07.REJECTION, broken, time_limit=30)
    assert result.score == 0 and "IndexError" in result.messages[0]
