"""Issue 19's engine features: logprobs and prompt logprobs, penalties, min_p, n > 1 with them,
and structured outputs (a grammar's token mask applied in the batched step).

References nobody here wrote: the model's full causal forward without any cache (for every
logprob), plain-Python loops over the definitions (penalties, min_p), `re.fullmatch` and
`jsonschema` (for what a grammar produced), and a hand-rolled greedy loop that masks with
llguidance's own matcher (for the constrained engine run). A tiny random-weight model with
SmolLM2's tokenizer keeps it fast; its text is meaningless but deterministic under greedy.
"""
import json
import re

import jsonschema
import pytest
from tiny import tiny_model
import torch

from minillm import SamplingParams, StructuredOutputsParams
from minillm.engine import LLM
from minillm.loader import _bundled_tokenizer
from minillm.sampling import apply_penalties, min_p_filter, probs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return _bundled_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_llm(model, tok, **kw):
    return LLM((model, tok), **{"num_kv_blocks": 128, "block_size": 16, **kw})


def full_logprobs(model, ids) -> torch.Tensor:
    """log_softmax of the model's plain causal forward (no cache): [len(ids), V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).float().log_softmax(-1)[0]


# --- penalties and min_p against their definitions ---------------------------------------------
def test_penalties_follow_the_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 3
    prompt, out = [1, 2, 2], [2, 5, 5, 5, 7]
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.7)
    got = apply_penalties(logits.clone(), p, prompt, out)[0]
    want = logits[0].tolist()
    for t in range(12):
        if t in prompt or t in out:
            want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
        want[t] -= 0.3 * out.count(t) + 0.7 * (t in out)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    neutral = SamplingParams()
    assert torch.equal(apply_penalties(logits.clone(), neutral, prompt, out), logits)


def test_min_p_keeps_tokens_within_the_ratio_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = torch.isfinite(min_p_filter(logits, 0.15))[0].tolist()
    assert kept == [True, True, True, False, False]          # threshold 0.15 * 0.5 = 0.075
    dist = probs(logits, SamplingParams(min_p=0.15))[0]
    assert torch.allclose(dist[:3], torch.tensor([0.5, 0.3, 0.1]) / 0.9, atol=1e-6)


@pytest.mark.parametrize("bad, needle", [
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
    (dict(min_p=1.2), "min_p"), (dict(structured_outputs={"json": {}}), "StructuredOutputs")])
def test_bad_values_name_the_field(bad, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**bad)


def test_structured_outputs_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


# --- logprobs ------------------------------------------------------------------------------------
def test_sampled_and_prompt_logprobs_match_the_uncached_forward(model, tok):
    """Chunked prefill (8 tokens per step) over a 30-token prompt: every prompt logprob and every
    output logprob equals the full forward's, top-k alternatives are the k most likely with
    their ranks, and the second identical request bypasses the prefix cache it would hit."""
    llm = make_llm(model, tok, max_num_batched_tokens=8, max_num_seqs=4)
    ids = list(range(300, 330))
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    for _ in range(2):                     # the second run would hit the prefix cache
        out = llm.generate([ids], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        seq = ids + out.token_ids
        ref = full_logprobs(model, seq)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(seq)):
            entry = (out.prompt_logprobs[i] if i < len(ids)
                     else out.outputs[0].logprobs[i - len(ids)])
            t = seq[i]
            assert entry[t].logprob == pytest.approx(float(ref[i - 1, t]), abs=1e-4)
            k = 2 if i < len(ids) else 3
            top = torch.topk(ref[i - 1], k)
            for rank, (v, j) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert entry[j].rank == rank and entry[j].logprob == pytest.approx(v, abs=1e-4)
            assert entry[t].rank == int((ref[i - 1] > ref[i - 1, t]).sum()) + 1
        lps = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.token_ids)]
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(lps), abs=1e-4)


def test_logprobs_are_the_raw_models_even_with_penalties_and_n(model, tok):
    """n=3 sampled with penalties: each sample's logprobs are the raw model's for its own
    tokens (vLLM's default), not the penalised distribution's."""
    llm = make_llm(model, tok)
    ids = [400, 401, 402, 403]
    out = llm.generate([ids], SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=3,
                                             logprobs=0, frequency_penalty=1.0,
                                             repetition_penalty=1.2), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        ref = full_logprobs(model, ids + c.token_ids)
        for i, (d, t) in enumerate(zip(c.logprobs, c.token_ids)):
            assert list(d) == [t]                              # logprobs=0: the token only
            assert d[t].logprob == pytest.approx(float(ref[len(ids) + i - 1, t]), abs=1e-4)


def test_greedy_with_penalties_follows_the_penalised_argmax(model, tok):
    llm = make_llm(model, tok)
    ids = [500, 501, 502]
    sp = SamplingParams(temperature=0, max_tokens=8, presence_penalty=1.5,
                        repetition_penalty=1.3)
    got = llm.generate([ids], sp, use_tqdm=False)[0].token_ids
    seq, want = list(ids), []
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1:].float()
        t = int(apply_penalties(logits, sp, ids, want).argmax())
        want.append(t)
        seq.append(t)
    assert got == want


# --- structured outputs --------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
    "name": {"type": "string", "maxLength": 6}},
    "required": ["ok", "color", "name"], "additionalProperties": False}


def test_constrained_greedy_equals_a_hand_masked_greedy_loop(model, tok):
    """The engine's constrained greedy decode equals greedy decoding that masks the model's full
    forward with llguidance's matcher by hand, step by step."""
    import llguidance
    import llguidance.hf
    import numpy as np
    llm = make_llm(model, tok)
    V = model.config.vocab_size
    so = StructuredOutputsParams(json=SCHEMA)
    ids = [600, 601, 602]
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=60,
                                             structured_outputs=so), use_tqdm=False)[0]
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=llm.engine.eos_token_id)
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}))
    seq, want = list(ids), []
    while len(want) < 60:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        mask = torch.from_numpy(bits[:V].astype(bool))
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1].float()
        t = int(logits.masked_fill(~mask, float("-inf")).argmax())
        want.append(t)
        seq.append(t)
        assert m.consume_token(t)
        if t == llm.engine.eos_token_id:
            break
    assert got.token_ids == want
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), SCHEMA)


def test_every_sample_parses_and_validates(model, tok):
    """Sampled at temperature 1 (n=4, two prompts, one batch): every output is valid JSON for
    the schema, every regex output matches, every choice is one of the choices."""
    llm = make_llm(model, tok)
    outs = llm.generate(
        [[700, 701], [702, 703, 704], [705], [706]],
        [SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))] * 2
        + [SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2}-\d{3}")),
           SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))],
        use_tqdm=False)
    for out in outs[:2]:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert all(re.fullmatch(r"[a-c]{2}-\d{3}", c.text) for c in outs[2].outputs)
    assert all(c.text in ("yes", "no") for c in outs[3].outputs)


def test_structured_requests_decode_without_drafts_next_to_speculating_ones(model, tok):
    """With ngram speculation on, the proposer is never asked for a grammar request's drafts
    (its output is the same as without speculation) while a plain request in the same batch is
    asked; prefix caching serves the second constrained run's prompt."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    plain = make_llm(model, tok)
    llm = make_llm(model, tok, speculative_config=spec)
    so = SamplingParams(temperature=0, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rep = SamplingParams(temperature=0, max_tokens=24)
    prompt = list(range(800, 840))
    want = plain.generate([prompt], so, use_tqdm=False)[0]
    asked, propose = [], llm.engine.proposer.propose
    llm.engine.proposer.propose = lambda reqs: asked.extend(r.token_ids[0] for r in reqs) \
        or propose(reqs)
    a, b = llm.generate([prompt, [7, 8, 7, 8, 7, 8, 7, 8]], [so, rep], use_tqdm=False)
    assert a.token_ids == want.token_ids
    assert 7 in asked and 800 not in asked          # first prompt tokens of the asks
    again = llm.generate([prompt], so, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.token_ids == want.token_ids


def test_a_grammar_failure_mid_generation_fails_that_request_only(model, tok):
    llm = make_llm(model, tok)

    class Breaks:
        """Allows everything, refuses the third token."""
        active, seen = True, 0

        def allowed(self, vocab_size):
            return None

        def accept(self, token):
            self.seen += 1
            if self.seen == 3:
                raise ValueError("token refused by the grammar")

        def fork(self):
            return self

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6)
    eng.add_request("bad", [900, 901], sp)
    eng.add_request("good", [900, 901], sp)
    eng.get_request("bad")[0].grammar = Breaks()
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs["bad"].finish_reason == "error" and "refused" in outs["bad"].error
    assert len(outs["bad"].token_ids) == 2
    assert outs["good"].finish_reason == "length" and len(outs["good"].token_ids) == 6


@pytest.mark.parametrize("so, needle", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "nonsense"),
    (StructuredOutputsParams(json='{"type": '), "not valid JSON"),
    (StructuredOutputsParams(regex="("), "regex"),
    (StructuredOutputsParams(regex=r"[^\s\S]"), "no token sequence")])
def test_a_bad_grammar_is_refused_before_it_runs(model, tok, so, needle):
    llm = make_llm(model, tok)
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=4, structured_outputs=so),
                       use_tqdm=False)[0]
    assert out.finish_reason == "error" and needle in out.error
