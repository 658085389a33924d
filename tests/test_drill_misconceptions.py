"""The drill's concept grader does not reward misconceptions, keyword salads or walls of text.

Each concept question whose topic has a known wrong claim carries `wrong:` patterns; an answer
that states one scores at most half and the feedback prints the correction. The claims driven
here are the course's own corrected misconceptions (issue 18) and the claim of every
spot-the-error item that has a concept question on the same point, fed both alone and appended
to the model answer (so the cap, not missing key points, is what keeps the score down).
"""
import pytest

from minillm.drill.bank import CAPPED_SCORE, get, load_bank
from minillm.drill.shape import overlong_reason, salad_reason

# (concept question, an answer that states a misconception the course corrects)
NAMED = [
    ("pfx.radix", "A radix tree reuses any repeated subsequence: edges are runs of tokens, "
                  "matched token by token, evicted leaf-first by LRU, for any prefix too."),
    ("spec.medusa", "Medusa drafts by skipping layers of the target: each extra head predicts "
                    "a position further ahead and the candidates are verified as a tree."),
    ("spec.medusa", "Medusa adds heads that share the lm_head; head i predicts the token i + 1 "
                    "positions ahead and the candidates are verified as a tree."),
    ("spec.rejection", "Accept a draft token when p/q > 0.5; otherwise resample from p - q "
                       "without normalising, and there is no bonus token. With greedy decoding "
                       "it accepts while the draft matches the argmax."),
    ("pfx.invalidation", "Never flush on a model reload: the KV is a deterministic function of "
                         "the prefix, the hash covers the full prefix and extras like the LoRA "
                         "adapter, and blocks are immutable."),
]

# spot-the-error item -> the concept question on the same point
SPOT_TO_CONCEPT = {
    "err.phase-bounds-swapped": "found.decode-slower-per-token",
    "err.decode-kv-dominates": "found.decode-slower-per-token",
    "err.vllm-pads": "batch.ragged-vs-padding", "err.tgi-static": "fw.landscape-time",
    "err.preempt-oldest": "sched.preemption", "err.preemption-priority": "sched.preemption",
    "err.preempt-swap-only": "sched.swap-vs-recompute",
    "err.short-prefix-sharing": "pfx.full-blocks-only",
    "err.beam-300-blocks": "paged.beam-sharing", "err.medusa-skip-layer": "spec.medusa",
    "err.llama70b-half-mb": "kv.per-token-70b-derivation",
    "err.spec-break-even-50": "spec.formula", "err.spec-kl-2x-compute": "spec.acceptance",
    "err.paging-overhead-5pct": "paged.paging-overhead", "err.50k-tok-s": "mem.70b-int8-h100",
    "err.radix-arbitrary-subsequences": "pfx.radix", "err.prefix-hit-cow": "pfx.how-sharing",
    "err.oom-is-kv": "sched.oom-hierarchy", "err.vllm-sjf-fair": "sched.policies",
    "err.cb-inconsistent-gains": "batch.why-throughput",
    "err.9x-throughput": "batch.why-throughput", "err.best-of-penalties": "sample.params",
    "err.smoothquant-rotation": "quant.gptq-awq-smoothquant", "err.waste-20-40": "frag.problem",
    "err.external-frag-max-length": "frag.internal-external",
    "err.a100-slightly-lower": "hw.gpu-generations", "err.fp8-hopper-only": "quant.fp8",
    "err.cuda-graphs-python": "serve.cuda-graphs",
    "err.enable-paging-on-preempt": "sched.memory-full",
    "err.ring-attention-limits-kv": "mem.128k-context", "err.vllm-innovation-cb": "fw.vllm",
    "err.gqa8-saves-8x": "kv.gqa", "err.mla-smaller-than-mqa": "kv.mla",
    "err.kv-query-heads-1000x": "kv.formula", "err.block-units": "paged.block",
    "err.chunked-alternate": "chunk.what", "err.latency-n-tpot": "found.ttft-tpot-itl",
    "err.gpu-util-headroom": "mem.vram-budget", "err.gpu-util-80": "serve.metrics-to-track",
    "err.static-old-gpus": "batch.static-when-ok",
    "err.size-thresholds-parallelism": "tp.vs-pp", "err.allocator-lock": "paged.alloc-speed",
    "err.unsourced-acceptance-table": "spec.temperature",
    "err.unsourced-50k-concurrency-gain": "paged.core-idea",
}


def grade(qid, text):
    return get(qid).instance(0).grade(text)


def test_enough_spot_items_are_driven():
    spots = {q.id for q in load_bank(kind="spot_the_error")}
    assert set(SPOT_TO_CONCEPT) <= spots
    assert len(SPOT_TO_CONCEPT) >= 30


@pytest.mark.parametrize("qid,answer", NAMED)
def test_named_misconceptions_score_at_most_half(qid, answer):
    g = grade(qid, answer)
    assert g.score <= 0.5, g.feedback
    assert "Misconception:" in g.feedback


@pytest.mark.parametrize("spot", sorted(SPOT_TO_CONCEPT))
def test_spot_claim_scores_at_most_half_even_inside_the_model_answer(spot):
    qid = SPOT_TO_CONCEPT[spot]
    claim = get(spot).prompt
    assert grade(qid, claim).score <= 0.5
    q = get(qid)
    g = grade(qid, q.instance(0).answer + " " + claim)   # every key point, plus the claim
    assert g.score == CAPPED_SCORE, g.feedback
    assert "Misconception:" in g.feedback


def test_every_wrong_pattern_is_exercised_and_no_model_answer_trips_one():
    for q in load_bank(kind="concept"):
        g = q.instance(0).grade(q.instance(0).answer)
        assert g.score == 1.0 and "Misconception" not in g.feedback, (q.id, g.feedback)
    covered = {SPOT_TO_CONCEPT[s] for s in SPOT_TO_CONCEPT} | {qid for qid, _ in NAMED}
    with_wrong = {q.id for q in load_bank(kind="concept") if q.wrong}
    assert with_wrong <= covered, with_wrong - covered


SALADS = [
    ("pfx.radix", "radix tree token level lru leaf prefix"),
    ("pfx.radix", "radix, tree, token-level, LRU, leaf, prefix"),
    ("spec.rejection", "min(1, p/q); residual max(0, p - q); bonus; greedy argmax"),
    ("kv.formula", "2 x layers x kv heads x head_dim x bytes"),
    ("chunk.what", "chunk\nbudget\nmax_num_batched_tokens\ndecode\nmix"),
]


@pytest.mark.parametrize("qid,answer", SALADS)
def test_keyword_salad_scores_at_most_half(qid, answer):
    g = grade(qid, answer)
    assert g.score <= 0.5, g.feedback
    assert "Not an answer yet" in g.feedback


def test_a_terse_real_answer_is_not_a_salad():
    g = grade("pfx.radix", "A radix tree of token sequences, matched per token, evicted "
                           "leaf-first by LRU; hits are still prefixes.")
    assert g.score == 1.0, g.feedback


def test_an_answer_many_times_the_model_answer_scores_at_most_half():
    q = get("pfx.radix")
    wall = " ".join([q.instance(0).answer] * 5)
    assert overlong_reason(wall, len(q.instance(0).answer.split()))
    assert grade("pfx.radix", wall).score <= 0.5
    assert grade("pfx.radix", " ".join([q.instance(0).answer] * 2)).score == 1.0


def test_shape_checks_leave_prose_alone():
    for q in load_bank(kind="concept"):
        answer = q.instance(0).answer
        if not salad_reason(answer):          # list-shaped model answers are exempt
            assert not overlong_reason(answer, len(answer.split()))


def test_mock_rubric_caps_a_keyword_salad_and_a_wall_of_text(tmp_path):
    from minillm.drill.mock import SHAPE_CAP, run_mock

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    salad = ("api server stream openai http scheduler queue kv block cache manager executor "
             "runner forward worker sampler detokenizer continuous iteration batch")
    wall = ("We should think about latency and throughput and the context lengths of the "
            "prompts and outputs, the model and its dtype, the gpu memory, the qps and the p99 "
            "slo, the cost budget and the tenants. ") * 12
    script = iter([wall, ".", salad, ".", "50", ".", ".", "", "", "."])

    def input_fn(prompt):
        clock.t += 60
        return next(script)

    r = run_mock(seed=0, input_fn=input_fn, output_fn=lambda *a: None, clock=clock,
                 report_dir=tmp_path, prompt_id="chat-70b", num_followups=2)
    design = next(p for p in r.phases if p.name == "high-level design")
    assert len(design.hits) == len(design.hits) + len(design.missed)   # every term is there ...
    assert r.rubric["high-level design"][0] <= SHAPE_CAP               # ... and it is capped
    assert "list of terms" in r.rubric["high-level design"][1]
    assert r.rubric["requirements"][0] <= SHAPE_CAP and "words for a" in r.rubric["requirements"][1]
