"""The official `openai` SDK against minillm: every feature of issue 19."""
import json

import httpx
import jsonschema
import openai

from common import BASE, MODEL, check

c = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=120)
C = "openai"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


@check(C, "completions n=2 + prompt list (index = prompt*n + sample)")
def _():
    r = c.completions.create(model=MODEL, prompt=["Once upon a time", "1, 2, 3,"], n=2,
                             max_tokens=6, temperature=0.8, seed=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3], r.choices
    assert r.usage.completion_tokens >= 4 and r.usage.prompt_tokens > 0   # >= 1 per choice
    return f"{len(r.choices)} choices"


@check(C, "token-id prompts, echo + logprobs (scoring)")
def _():
    ids = httpx.post(BASE + "/tokenize", json={"prompt": "The capital of France is Paris",
                                               "add_special_tokens": False}).json()["tokens"]
    r = c.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=1, temperature=0,
                             logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    return f"logprob(' Paris' | prompt) = {lp.token_logprobs[len(ids) - 1]:.3f}"


@check(C, "logprobs=0 answered (not null)")
def _():
    r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0, temperature=0)
    assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.tokens) == 3
    return ""


@check(C, "OpenAI's defaults best_of=1, response_format text, store, metadata")
def _():
    r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=1)
    r2 = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                   max_completion_tokens=2, response_format={"type": "text"},
                                   store=False, metadata={"k": "v"})
    return repr(r.choices[0].text) + " " + repr(r2.choices[0].message.content)


@check(C, "chat logprobs + top_logprobs")
def _():
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=4, logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    return f"{len(content)} tokens"


@check(C, "chat n=2, seed reproducible")
def _():
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell a joke"}], max_tokens=8,
              n=2, seed=7, temperature=1.0)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    return f"{len(a.choices)} choices"


@check(C, "penalties and min_p")
def _():
    r = c.completions.create(model=MODEL, prompt="the the the the", max_tokens=8, temperature=0,
                             presence_penalty=1.0, frequency_penalty=1.0,
                             extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    return repr(r.choices[0].text)


@check(C, "stream include_usage + continuous_usage_stats")
def _():
    chunks = list(c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True}))
    assert chunks[-1].usage.completion_tokens == 6
    assert all(ch.usage is not None for ch in chunks)
    return f"{len(chunks)} chunks"


@check(C, "response_format json_schema validates")
def _():
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city and its population as JSON"}],
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": SCHEMA}})
    obj = json.loads(r.choices[0].message.content)
    jsonschema.validate(obj, SCHEMA)
    return r.choices[0].message.content


@check(C, "response_format json_object parses (every choice that finished)")
def _():
    r = c.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": 'Answer with a JSON object like {"answer": "yes"}.'},
        {"role": "user", "content": "Is the sky blue?"}], max_tokens=100, n=4, seed=0,
        temperature=0.7, response_format={"type": "json_object"})
    done = [ch for ch in r.choices if ch.finish_reason == "stop"]
    assert done, "no choice finished within 100 tokens"
    assert all(isinstance(json.loads(ch.message.content), dict) for ch in done)
    return f"{len(done)}/4 finished and parse: {done[0].message.content[:60]}"


@check(C, "guided_json / guided_regex / guided_choice")
def _():
    a = c.completions.create(model=MODEL, prompt="Is water wet?", max_tokens=5,
                             extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
    b = c.completions.create(model=MODEL, prompt="Code:", max_tokens=10,
                             extra_body={"guided_regex": r"[A-Z]{3}-\d{3}"}).choices[0].text
    small = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                              "color": {"enum": ["red", "green"]}},
             "required": ["ok", "color"], "additionalProperties": False}
    d = c.completions.create(model=MODEL, prompt="Flag:", max_tokens=40, temperature=0,
                             extra_body={"guided_json": small}).choices[0].text
    import re
    assert a in ("yes", "no") and re.fullmatch(r"[A-Z]{3}-\d{3}", b)
    jsonschema.validate(json.loads(d), small)      # bounded: an unbounded integer can run
    return f"{a} {b} {d}"                          # past max_tokens (finish_reason length)


@check(C, "unknown model -> NotFoundError (404)")
def _():
    try:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        return str(e)[:80]
    raise AssertionError("no error")


@check(C, "bad input -> BadRequestError (logprobs 21, n 17, bad schema, empty regex)")
def _():
    bad = [dict(logprobs=21), dict(n=17),
           dict(extra_body={"guided_json": {"type": "nonsense"}}),
           dict(extra_body={"guided_regex": r"[^\s\S]"})]
    for kw in bad:
        try:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
        except openai.BadRequestError:
            continue
        raise AssertionError(f"{kw} accepted")
    return f"{len(bad)} refused"


@check(C, "/tokenize and /detokenize")
def _():
    t = httpx.post(BASE + "/tokenize", json={"prompt": "hello world"}).json()
    d = httpx.post(BASE + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"].endswith("hello world") and t["count"] == len(t["tokens"])
    return str(t["tokens"])
