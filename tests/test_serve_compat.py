"""Issue 19's API compatibility, through the real `openai` client and raw HTTP: n and prompt
lists (choice indexes as OpenAI numbers them), token-id prompts, echo + logprobs (what lm-eval's
multiple-choice scoring sends), chat logprobs, every sample streamed, continuous usage, OpenAI's
defaults accepted, structured outputs validated with jsonschema, /tokenize and /detokenize.

References: the model's plain causal forward (logprobs), the server's own non-streamed answers
(streams), offline `LLM.generate` (n samples), jsonschema, the tokenizer itself.
"""
import json

import httpx
import jsonschema
import openai
import pytest
import torch

from minillm import SamplingParams, StructuredOutputsParams
from minillm.engine import LLM
from minillm.serve.api_server import BackgroundServer

from test_serve import MODEL, make_engine, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green"]},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["ok", "color", "name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from minillm.loader import _bundled_tokenizer
    return _bundled_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model, tok):
    with BackgroundServer(make_engine(model, tok), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def test_prompt_list_times_n_numbers_choices_like_openai(client, model, tok):
    """Two prompts x n=2, seeded: choice index = prompt * n + sample, each text equal to the
    offline engine's sample with the same seed; usage counts every choice's tokens."""
    prompts = ["Hello there", "A list:"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, seed=11,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    llm = LLM((model, tok), num_kv_blocks=64)
    for i, p in enumerate(prompts):
        offline = llm.generate([p], SamplingParams(n=2, max_tokens=5, seed=11, ignore_eos=True),
                               use_tqdm=False)[0]
        assert [c.text for c in r.choices[2 * i:2 * i + 2]] == [o.text for o in offline.outputs]
    assert r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_echo_logprobs_on_token_id_prompts_score_like_the_forward(client, model):
    """lm-eval's multiple-choice request: token-id prompts in a batch, max_tokens 1, echo,
    logprobs 1. token_logprobs[0] is None, the rest equal the plain forward's log_softmax, and
    top_logprobs holds the greedy token (so max(top) == logprob exactly when greedy)."""
    prompts = [[300, 301, 302, 303, 304], [310, 311, 312]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    for ids, ch in zip(prompts, r.choices):
        lp = ch.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + 1 == len(lp.text_offset)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).float().log_softmax(-1)[0]
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
            assert max(lp.top_logprobs[i].values()) == pytest.approx(float(ref[i - 1].max()),
                                                                     abs=1e-4)
        assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert ch.text.startswith("".join(lp.tokens[:len(ids)]))


def test_logprobs_zero_is_answered_and_chat_top_logprobs_has_k(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 1 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)


def test_every_sample_streams_and_equals_the_nonstreamed_answer(client):
    """n=2 streamed with logprobs and continuous_usage_stats: each choice's chunks concatenate to
    the non-streamed choice, its logprob entries cover its tokens, every chunk carries usage."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=7,
              n=2, seed=4, temperature=1.0, logprobs=True, top_logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    texts, lps, usages = {0: "", 1: ""}, {0: 0, 1: 0}, []
    for ch in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **kw):
        usages.append(ch.usage)
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            lps[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert lps == {0: 7, 1: 7}
    assert all(u is not None for u in usages) and usages[-1].completion_tokens == 14


def test_openai_defaults_and_client_fields_are_accepted(client, server):
    """What OpenAI clients send by default or as bookkeeping: best_of=1, response_format text,
    store, metadata, parallel_tool_calls; echo on a stream puts the prompt first."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=1)
    assert r.choices[0].finish_reason in ("stop", "length")
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=2, response_format={"type": "text"},
                                       store=False, metadata={"run": "1"},
                                       parallel_tool_calls=False)
    assert c.choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2,
                                            echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).startswith("Echo me")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


@pytest.mark.parametrize("fmt", ["response_format", "guided_json"])
def test_json_schema_outputs_validate(client, fmt):
    body = ({"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA}}}
            if fmt == "response_format" else {"guided_json": SCHEMA})
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "j"}],
                                       max_tokens=60, n=3, temperature=1.0, seed=2,
                                       extra_body=body)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_regex_choice_and_json_object(client):
    a = client.completions.create(model=MODEL, prompt="?", max_tokens=10,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    b = client.completions.create(model=MODEL, prompt="?", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_regex": r"\d{2}-[xy]"})
    assert a.choices[0].text in ("alpha", "beta")
    assert len(b.choices[0].text) == 4 and b.choices[0].text[2] == "-"
    c = client.completions.create(model=MODEL, prompt="?", max_tokens=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].text.startswith("{")          # 3 tokens: a prefix of an object


def test_tokenize_and_detokenize_round_trip(server, tok):
    with httpx.Client(base_url=server.base_url, timeout=30) as h:
        t = h.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                      "return_token_strs": True}).json()
        assert t["tokens"] == tok.encode("hello world", add_special_tokens=False)
        assert t["count"] == 2 and "".join(t["token_strs"]) == "hello world"
        m = h.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tok.decode(m["tokens"]).startswith("<|im_start|>")
        assert h.post("/detokenize", json={"tokens": t["tokens"]}).json() == {
            "prompt": "hello world"}
        info = h.get("/tokenizer_info").json()
        assert info["eos_token"] == tok.eos_token and info["chat_template"]
        bad = h.post("/detokenize", json={"tokens": [10 ** 7]})
        assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]
        assert h.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


def test_structured_outputs_params_reach_the_engine_unchanged():
    """The protocol maps each request form onto vLLM's StructuredOutputsParams."""
    from minillm.serve.protocol import CompletionRequest
    base = {"model": MODEL, "prompt": "x"}
    assert CompletionRequest(**base, guided_regex="a+").structured_outputs() == \
        StructuredOutputsParams(regex="a+")
    assert CompletionRequest(**base, response_format={"type": "json_object"}
                             ).structured_outputs() == StructuredOutputsParams(json_object=True)
    assert CompletionRequest(**base, response_format={"type": "text"}).structured_outputs() \
        is None
