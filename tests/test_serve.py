"""The OpenAI-compatible server (minillm.serve) through the real `openai` client.

A server runs in a thread of the test process on a free loopback port (BackgroundServer), over a
tiny random-weight model that shares SmolLM2's tokenizer: fast, and its text is meaningless but
deterministic under greedy decoding, which is all these checks need. The references are the
server's own non-streamed answers and offline `minillm.LLM.generate` on the same weights. The
bundled model is used where a real chat template matters; SIGTERM and port-in-use run the real
command line in a subprocess (test_serve_process.py).
"""
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import minillm
from minillm import SamplingParams, configs
from minillm.engine import LLM, LLMEngine
from minillm.loader import _bundled_tokenizer, random_model
from minillm.serve.api_server import BackgroundServer

MODEL = "tiny-test"
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)


@pytest.fixture(scope="module")
def tok():
    return _bundled_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_engine(model, tok, **kw):
    kw = {"num_kv_blocks": 512, "block_size": 16, "max_num_seqs": 64, **kw}
    return LLMEngine(model, tok, **kw)


@pytest.fixture(scope="module")
def server(model, tok):
    with BackgroundServer(make_engine(model, tok), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def metric_samples(base_url) -> dict:
    """{(name, frozenset(labels without model_name)): value} from GET /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def wait_idle(engine, timeout=20.0):
    """Until the engine has nothing left (aborts are processed between steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished():       # True until every output was returned
            return
        time.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout}s")


def stream_completion(client, **kw):
    """(text, finish_reasons of every chunk, usage) of a streamed completion."""
    parts, reasons, usage = [], [], None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.text)
            reasons.append(c.finish_reason)
    return "".join(parts), reasons, usage


# --- the engine thread and the exporter, against a scripted engine --------------------------------
def step_stats(**kw):
    """A StepStats of an idle 100-block engine, with the given fields changed."""
    from minillm.engine import StepStats
    base = dict(num_batched_tokens=0, num_prefill_tokens=0, num_decode_tokens=0, num_seqs=0,
                num_prefill_seqs=0, num_preempted=0, num_waiting=0, num_running=0,
                num_swapped=0, num_free_blocks=100, num_kv_blocks=100, duration=0.0)
    return StepStats(**{**base, **kw})


class ScriptedEngine:
    """Only the surface AsyncEngine may use (add_request, abort_request, has_unfinished,
    step_outputs, decode): any other attribute it reads is an AttributeError, which kills the
    engine thread and times the test out. Token ids are bytes; a request's script is the tokens
    of each step, its last step finishes it with `reason`."""

    def __init__(self, scripts: dict):
        self.scripts = scripts                 # request_id -> (list of bytes per step, reason)
        self.live, self.aborted = {}, []

    def add_request(self, request_id, ids, params, arrival_time=None):
        if request_id not in self.scripts:
            raise ValueError(f"no script for {request_id}")
        steps, reason = self.scripts[request_id]
        self.live[request_id] = (iter(steps), reason, [])

    def abort_request(self, request_id):
        if self.live.pop(request_id, None) is None:
            return False
        self.aborted.append(request_id)
        return True

    def has_unfinished(self):
        return bool(self.live or self.aborted)

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def _output(self, rid, ids, reason, error=None):
        from minillm.engine.outputs import CompletionOutput, RequestOutput
        text = self.decode(ids).split("END")[0]           # the engine cuts the stop string
        return RequestOutput(rid, None, [1], [CompletionOutput(0, text, list(ids), reason)],
                             error=error)

    def step_outputs(self):
        from minillm.engine.outputs import StepOutput, TokenDelta
        time.sleep(0.005)
        finished = [self._output(rid, [], "abort") for rid in self.aborted]
        deltas, self.aborted = [], []
        for rid, (steps, reason, ids) in list(self.live.items()):
            toks = next(steps)
            ids.extend(toks)
            done = toks.endswith(b"END") or reason == "error"
            deltas.append(TokenDelta(request_id=rid, index=0, token_ids=tuple(toks),
                                     num_output_tokens=len(ids), finished=done))
            if done:
                del self.live[rid]
                finished.append(self._output(rid, ids, reason, "boom" if reason == "error"
                                             else None))
        return StepOutput(finished=finished, deltas=deltas,
                          stats=step_stats(num_running=len(self.live)))


def test_async_engine_turns_step_outputs_into_typed_events():
    """The text of each TokenDelta goes out as a TextDelta, holding back half a UTF-8 character
    and what could start a stop string; the finishing step's tokens come only with Finished;
    an engine error is Failed, a refused add is Failed, shutdown is Aborted. The observer sees
    every StepStats and every finished output."""
    from minillm.serve.async_engine import Aborted, AsyncEngine, Failed, Finished, TextDelta

    class Recorder:
        def __init__(self):
            self.stats, self.finished = [], []

        def on_step(self, stats):
            self.stats.append(stats)

        def on_finished(self, out):
            self.finished.append(out.request_id)

    def endless():
        while True:
            yield b"x"

    scripts = {"a": ([b"Hi", b" \xc3", b"\xa9!", b"ok", b"zEND"], "stop"),
               "b": ([b"no", b"pe"], "error"), "d": (endless(), "length")}
    rec = Recorder()
    aengine = AsyncEngine(ScriptedEngine(scripts), observer=rec, idle_wait=0.01)

    async def events_of(q):
        out = []
        while not out or isinstance(out[-1], TextDelta):
            out.append(await asyncio.wait_for(q.get(), 10))
        return out

    async def main():
        aengine.start()
        try:
            params = SamplingParams(max_tokens=64, stop=["END"])
            qa, qb, qc = (aengine.submit(r, [1], params, 0.0) for r in "abc")
            got = [await events_of(q) for q in (qa, qb, qc)]
            qd = aengine.submit("d", [1], SamplingParams(max_tokens=64), 0.0)
            assert isinstance(await asyncio.wait_for(qd.get(), 10), TextDelta)
        finally:
            aengine.stop()
        return got, await events_of(qd)

    (a, b, c), d = asyncio.run(main())
    assert a[:-1] == [TextDelta("Hi ", 6), TextDelta("é!", 8)]      # 2 chars held for "END"
    assert isinstance(a[-1], Finished) and a[-1].output.text == "Hi é!okz"
    assert b == [Failed("boom")]
    assert len(c) == 1 and isinstance(c[0], Failed) and "no script for c" in c[0].message
    assert isinstance(d[-1], Aborted) and all(isinstance(e, TextDelta) for e in d[:-1])
    assert {"a", "b", "d"} <= set(rec.finished) and rec.stats
    assert not aengine.is_running


def test_metrics_gauges_and_preemptions_come_from_step_stats():
    """on_step sets the gauges from one StepStats; the preemption counter follows the engine's
    cumulative total without counting a step twice; the prefix-cache hit rate is NaN until a
    prompt token was looked up (as with prefix caching off), then hits / queries."""
    from minillm.serve.metrics import ServerMetrics, parse_metrics
    sm = ServerMetrics("m")
    none = frozenset()
    sm.on_step(step_stats(num_running=3, num_waiting=2, num_free_blocks=75,
                          total_preemptions=2))
    m = parse_metrics(sm.text())
    assert (m[("minillm:num_requests_running", none)], m[("minillm:num_requests_waiting", none)]) \
        == (3, 2)
    assert m[("minillm:kv_blocks_in_use", none)] == 25
    assert m[("minillm:kv_cache_usage_perc", none)] == pytest.approx(0.25)
    assert m[("minillm:num_preemptions_total", none)] == 2
    assert m[("minillm:prefix_cache_hit_rate", none)] != m[("minillm:prefix_cache_hit_rate", none)]
    for _ in range(2):                          # the same cumulative total twice: counted once
        sm.on_step(step_stats(total_preemptions=5, prefix_cache_queries=64,
                              prefix_cache_hits=48))
    m = parse_metrics(sm.text())
    assert m[("minillm:num_preemptions_total", none)] == 5
    assert m[("minillm:prefix_cache_hit_rate", none)] == pytest.approx(0.75)
    assert m[("minillm:kv_blocks_in_use", none)] == 0


# --- correctness against the server's own non-streamed answers and offline generate ------------
@pytest.mark.parametrize("prompt,max_tokens", [("The capital of France is", 24),
                                               ("Once upon a time, in a land", 40)])
def test_completion_stream_equals_nonstream(client, tok, prompt, max_tokens):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    full = client.completions.create(**kw)
    text, reasons, usage = stream_completion(client, **kw)
    assert text == full.choices[0].text and text
    assert [r for r in reasons if r is not None] == [full.choices[0].finish_reason]
    assert reasons[-1] is not None                        # the finish_reason comes last
    n_prompt = len(tok.encode(prompt))
    assert full.usage.prompt_tokens == usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == usage.completion_tokens
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == max_tokens


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client, tok):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI's API names it: 0 the first time a
    long prompt is seen, whole 16-token blocks of it the second time, streamed or not."""
    prompt = " ".join(f"item {i} of a list that is long enough to fill several blocks"
                      for i in range(8))
    n_prompt = len(tok.encode(prompt))
    assert n_prompt > 64
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and n_prompt - 16 <= cached < n_prompt   # the last token is recomputed
    _, _, usage = stream_completion(client, **kw)
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_stop_string_cut_identically_when_streamed(client, model, tok):
    """A stop string that spans two tokens: the stream must hold back the text that could be
    its start, so the streamed text equals the non-streamed one (cut before the stop)."""
    prompt = "The history of computing"
    ref = LLM((model, tok), num_kv_blocks=64).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    texts = [tok.decode(ref.token_ids[:k], skip_special_tokens=True)
             for k in range(len(ref.token_ids) + 1)]
    stop = None
    for k in range(2, len(texts) - 1):         # 2+ chars from token k, 2+ from token k + 1
        a, b = len(texts[k]), len(texts[k + 1])
        if a - len(texts[k - 1]) >= 2 and b - a >= 2 and texts[k + 1].startswith(texts[k]):
            cand = texts[k + 1][a - 2:a + 2]
            if cand.strip() and texts[k + 1].find(cand) == a - 2:
                stop = cand
                break
    assert stop is not None, "no token boundary to put a stop string across"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert client.completions.create(**kw).choices[0].text == ref.text
    cut = client.completions.create(stop=[stop], **kw)
    text, reasons, _ = stream_completion(client, stop=[stop], **kw)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == ref.text[:ref.text.find(stop)]
    assert text == cut.choices[0].text
    assert [r for r in reasons if r] == ["stop"]


def test_32_parallel_streams_match_offline_generate(server, model, tok):
    """32 concurrent streams with mixed prompt and output lengths: each gets exactly the text and
    token count of offline LLM.generate on the same weights."""
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(2, 40))] for _ in range(32)]
    max_tokens = [rng.randint(4, 24) for _ in range(32)]
    llm = LLM((model, tok), num_kv_blocks=512)
    offline = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m)
                                     for m in max_tokens], use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none",
                                 max_retries=0, timeout=60)

    async def one(p, m):
        parts, reasons, usage = [], [], None
        stream = await aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=m, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for ch in stream:
            usage = ch.usage or usage
            for c in ch.choices:
                parts.append(c.text)
                reasons.append(c.finish_reason)
        return "".join(parts), [r for r in reasons if r], usage

    async def all_of_them():
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(one(p, m) for p, m in zip(prompts, max_tokens))), timeout=90)
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    for (text, reasons, usage), ref, p in zip(results, offline, prompts):
        assert text == ref.text
        assert reasons == [ref.finish_reason]
        assert usage.completion_tokens == len(ref.token_ids)
        assert usage.prompt_tokens == len(p)
    wait_idle(server.app.state.engine)


def test_burst_of_100_short_requests(server):
    async def burst():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none",
                                      max_retries=0, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=f"Request number {i}:", max_tokens=4,
                                     temperature=0) for i in range(100))), timeout=90)

    results = asyncio.run(burst())
    assert len(results) == 100
    assert all(r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
               for r in results)
    assert len({r.id for r in results}) == 100
    eng = server.app.state.engine
    wait_idle(eng)
    assert eng.block_manager.num_free_blocks == eng.num_kv_blocks


# --- the API surface ----------------------------------------------------------------------------
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server.base_url + "/health", timeout=10)
    assert h.status_code == 200
    before = metric_samples(server.base_url)
    r = client.completions.create(model=MODEL, prompt="Counting: one two", max_tokens=6,
                                  temperature=0)
    wait_idle(server.app.state.engine)
    after = metric_samples(server.base_url)

    def delta(name, labels=frozenset()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    n = r.usage.completion_tokens
    assert delta("minillm:time_to_first_token_seconds_count") == 1
    assert delta("minillm:e2e_request_latency_seconds_count") == 1
    assert delta("minillm:inter_token_latency_seconds_count") == n - 1
    assert delta("minillm:generation_tokens_total") == n
    assert delta("minillm:prompt_tokens_total") == r.usage.prompt_tokens
    reason = frozenset({("finished_reason", r.choices[0].finish_reason)})
    assert delta("minillm:request_success_total", reason) == 1
    assert after[("minillm:num_requests_running", frozenset())] == 0
    assert after[("minillm:num_requests_waiting", frozenset())] == 0
    assert after[("minillm:kv_blocks_in_use", frozenset())] == 0
    rate = after[("minillm:prefix_cache_hit_rate", frozenset())]
    eng = server.app.state.engine
    stats = getattr(eng, "prefix_cache_stats", None)
    if stats is None:
        assert rate != rate                                # NaN: no prefix cache to report
    else:
        assert rate == pytest.approx(stats.hit_rate)


def test_chat_stream_equals_nonstream_bundled_model():
    """Real weights and the real chat template: streamed chat text == non-streamed."""
    from minillm.serve.api_server import chat_prompt_ids
    model, tok = minillm.load_model("smollm2-135m")
    eng = LLMEngine(model, tok, num_kv_blocks=64)
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Name a colour."}]
    with BackgroundServer(eng, "smollm2-135m") as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                          timeout=60)
        kw = dict(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
        full = c.chat.completions.create(**kw)
        parts, reasons, roles, usage = [], [], [], None
        for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw):
            usage = ch.usage or usage
            for choice in ch.choices:
                parts.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
                roles.append(choice.delta.role)
    text = full.choices[0].message.content
    assert "".join(parts) == text and text.strip()
    assert [r for r in reasons if r] == [full.choices[0].finish_reason]
    assert roles[0] == "assistant" and full.choices[0].message.role == "assistant"
    ids = chat_prompt_ids(tok, messages)
    assert full.usage.prompt_tokens == usage.prompt_tokens == len(ids)
    ref = minillm.generate(model, tok, ids, max_new_tokens=16,
                           sampling=SamplingParams(temperature=0.0))
    assert full.usage.completion_tokens == len(ref) + (full.choices[0].finish_reason == "stop")
    assert text == tok.decode(ref, skip_special_tokens=True)


# --- disconnects, bad input, load shedding ------------------------------------------------------
def test_client_dropped_mid_stream_is_aborted_and_frees_its_blocks(server):
    eng = server.app.state.engine
    before = metric_samples(server.base_url)
    body = {"model": MODEL, "prompt": "A very long story begins", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]        # a few chunks, then hang up
            assert any(x.startswith("data: {") for x in got)
            assert eng.block_manager.num_free_blocks < eng.num_kv_blocks   # it holds blocks
    wait_idle(eng)
    assert eng.block_manager.num_free_blocks == eng.num_kv_blocks
    assert not eng.block_manager.tables
    after = metric_samples(server.base_url)
    key = ("minillm:request_success_total", frozenset({("finished_reason", "abort")}))
    assert after.get(key, 0) - before.get(key, 0) == 1        # aborted, not run to the end
    assert after[("minillm:kv_blocks_in_use", frozenset())] == 0


BAD_BODIES = [
    ("malformed JSON", b'{"model": "tiny-test", "prompt": "hi",', "JSON"),
    ("not an object", b'["tiny-test"]', "body"),
    ("wrong type max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("wrong type temperature", {"model": MODEL, "prompt": "hi", "temperature": "hot"},
     "temperature"),
    ("prompt is a number", {"model": MODEL, "prompt": 7}, "prompt"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens -3", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("prompt too long", {"model": MODEL, "prompt": "word " * 300, "max_tokens": 4}, "context"),
    ("output past context", {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, "empty"),
    ("token id out of range", {"model": MODEL, "prompt": [1, 10 ** 7]}, "token ids"),
    ("unknown field", {"model": MODEL, "prompt": "hi", "temprature": 0}, "temprature"),
    ("unsupported field", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5}},
     "logit_bias"),
    ("top_p out of range", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("too many prompts", {"model": MODEL, "prompt": ["a"] * 65}, "at most 64"),
    ("one bad prompt of two", {"model": MODEL, "prompt": ["a", ""]}, "empty"),
    ("logprobs over 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("n over the cap", {"model": MODEL, "prompt": "hi", "n": 17}, "n must be"),
    ("best_of != n", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
    ("presence_penalty out of range", {"model": MODEL, "prompt": "hi", "presence_penalty": 3},
     "presence_penalty"),
    ("min_p out of range", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ("invalid JSON schema", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "nope"}},
     "grammar"),
    ("regex no token sequence matches", {"model": MODEL, "prompt": "hi",
                                         "guided_regex": "[^\\s\\S]"}, "no token sequence"),
    ("bad regex", {"model": MODEL, "prompt": "hi", "guided_regex": "("}, "regex"),
    ("two grammars", {"model": MODEL, "prompt": "hi", "guided_regex": "a",
                      "guided_choice": ["a"]}, "one of"),
    ("bad response_format", {"model": MODEL, "prompt": "hi",
                             "response_format": {"type": "xml"}}, "response_format"),
    ("json_schema without a schema", {"model": MODEL, "prompt": "hi",
                                      "response_format": {"type": "json_schema"}}, "schema"),
    ("echo over the context", {"model": MODEL, "prompt": "word " * 300, "echo": True,
                               "logprobs": 1, "max_tokens": 1}, "context"),
]


def test_bad_requests_get_400_while_another_stream_runs(server, client):
    """Each bad request is a 400 with an OpenAI error body naming the problem; a stream running
    meanwhile is untouched (same text as when it runs alone)."""
    kw = dict(model=MODEL, prompt="Steady stream", max_tokens=60, temperature=0,
              extra_body={"ignore_eos": True})
    alone = client.completions.create(**kw).choices[0].text
    result = {}
    t = threading.Thread(target=lambda: result.update(text=stream_completion(client, **kw)[0]))
    t.start()
    with httpx.Client(timeout=30) as h:
        for name, body, needle in BAD_BODIES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = h.post(server.base_url + "/v1/completions", content=content,
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["type"] == "invalid_request_error", name
            assert needle.lower() in err["message"].lower(), (name, err["message"])
        for body, needle in [({"model": MODEL, "messages": []}, "messages"),
                             ({"model": MODEL, "messages": [{"role": "user"}]}, "content"),
                             ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                              "role"),
                             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"type": "function"}]}, "tools"),
                             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "top_logprobs": 2}, "logprobs=true"),
                             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
            r = h.post(server.base_url + "/v1/chat/completions", json=body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = h.post(server.base_url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    t.join(60)
    assert result["text"] == alone
    with pytest.raises(openai.BadRequestError) as e:       # what a client program sees
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)
    ok = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_waiting_queue_bound_gives_429_not_unbounded_queueing(model, tok):
    """max_num_seqs=1 and max_waiting=2: a burst of 16 gets some 429s (rate_limit_error, with
    Retry-After), the admitted ones all complete, and the server serves again afterwards."""
    eng = make_engine(model, tok, max_num_seqs=1)
    with BackgroundServer(eng, MODEL, max_waiting=2) as srv:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(*(h.post(
                    srv.base_url + "/v1/completions",
                    json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 16,
                          "ignore_eos": True}) for i in range(16)))

        rs = asyncio.run(asyncio.wait_for(burst(), 90))
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}
        assert codes.count(429) >= 1 and codes.count(200) >= 2      # at least max_waiting in
        for r in rs:
            if r.status_code == 429:
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.headers["retry-after"] == "1"
            else:
                assert r.json()["usage"]["completion_tokens"] == 16
        m = metric_samples(srv.base_url)
        assert m[("minillm:requests_rejected_total",
                  frozenset({("reason", "queue_full")}))] == codes.count(429)
        wait_idle(eng)
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="after", max_tokens=2).usage
    assert eng.block_manager.num_free_blocks == eng.num_kv_blocks


def test_preemptions_show_in_metrics(model, tok):
    """A pool too small for the batch preempts (it never runs out of memory); /metrics counts
    every preemption the engine made and all requests still finish."""
    eng = make_engine(model, tok, num_kv_blocks=12, block_size=4, max_num_seqs=8)
    with BackgroundServer(eng, MODEL) as srv:
        async def burst():
            async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none",
                                          max_retries=0, timeout=60) as c:
                return await asyncio.gather(*(c.completions.create(
                    model=MODEL, prompt=[5 + i, 6, 7, 8], max_tokens=20,
                    extra_body={"ignore_eos": True}, temperature=0) for i in range(8)))

        rs = asyncio.run(asyncio.wait_for(burst(), 90))
        assert all(r.usage.completion_tokens == 20 for r in rs)
        wait_idle(eng)
        m = metric_samples(srv.base_url)
    assert eng.num_preemptions > 0
    assert m[("minillm:num_preemptions_total", frozenset())] == eng.num_preemptions


def test_a_fault_in_one_requests_step_fails_that_request_only(model, tok):
    """The engine isolates a failure inside one request's step (here its stop check raises
    after 4 tokens): that request gets an error (a 500 or an error event in its stream), the
    requests running beside it get exactly the text they get alone, and the server goes on."""
    import types
    eng = make_engine(model, tok)
    real = eng._check_stop

    def poisoned(self, req):
        if req.params.seed == 666 and req.num_output_tokens >= 4:
            raise RuntimeError("injected stop-check fault")
        return real(req)

    eng._check_stop = types.MethodType(poisoned, eng)
    prompts = ["alpha beta", "gamma delta epsilon", "zeta"]
    with BackgroundServer(eng, MODEL) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                          timeout=60)
        alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
                 for p in prompts]
        results, errors = {}, {}

        def healthy(i):
            results[i] = stream_completion(c, model=MODEL, prompt=prompts[i], max_tokens=20,
                                           temperature=0, extra_body={"ignore_eos": True})[0]

        def poisoned_call(stream):
            try:
                kw = dict(model=MODEL, prompt="poison", max_tokens=20, seed=666)
                if stream:
                    stream_completion(c, **kw)
                else:
                    c.completions.create(**kw)
            except openai.APIError as e:
                errors[stream] = e

        threads = [threading.Thread(target=healthy, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=poisoned_call, args=(s,)) for s in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [results[i] for i in range(3)] == alone
        assert set(errors) == {False, True}
        assert isinstance(errors[False], openai.InternalServerError)
        assert "injected stop-check fault" in str(errors[False])
        assert "injected stop-check fault" in str(errors[True])
        wait_idle(eng)
        assert eng.block_manager.num_free_blocks == eng.num_kv_blocks
        assert c.completions.create(model=MODEL, prompt="after", max_tokens=3).usage
        m = metric_samples(srv.base_url)
        assert m[("minillm:request_success_total", frozenset({("finished_reason", "error")}))] == 2


def test_replay_advances_its_virtual_clock_by_the_step_cost():
    """The replay's clock moves by exactly cost(tokens, sequences) per step, and Little's law
    holds on what it measures (the notebook's sweep relies on both)."""
    from minillm.lab.serving_replay import StepCost, poisson_trace, replay_serving
    from minillm.metrics import summarize
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=1, hidden_size=16, intermediate_size=32, num_heads=2,
        num_kv_heads=1, head_dim=8, vocab_size=32, max_position_embeddings=256)
    tiny = random_model(cfg, "cpu", torch.float32)
    cost = StepCost(fixed=0.04, per_token=0.002, per_seq=0.001)
    run = replay_serving(tiny, poisson_trace([[1] * 16] * 8, [5] * 8, float("inf")), cost,
                         max_num_seqs=8, num_kv_blocks=16, block_size=16,
                         max_num_batched_tokens=128)
    # step 1: 8 prompts of 16 tokens; steps 2-5: 8 decodes
    assert [(s.num_tokens, s.num_seqs) for s in run.steps] == [(128, 8)] + [(8, 8)] * 4
    assert run.end_time == pytest.approx(cost(128, 8) + 4 * cost(8, 8))
    assert all(o.metrics.ttft == pytest.approx(cost(128, 8)) for o in run.outputs)
    run = replay_serving(tiny, poisson_trace([[1] * 16] * 40, [5] * 40, 10.0, seed=1), cost,
                         max_num_seqs=4, num_kv_blocks=32, block_size=16, max_num_batched_tokens=64)
    s = summarize(run.metrics)
    little = s["request_throughput"] * s["e2e_latency_mean"]
    assert run.time_average_in_system() == pytest.approx(little, rel=0.1)


def test_load_generator_against_the_server(server, tok):
    """bench_serve.py's client: every request completes with its workload output length (EOS
    ignored), the client-side timings are consistent, and the summary uses vLLM's definitions."""
    from minillm.lab.workloads import workload_requests
    from minillm.metrics import summarize
    from minillm.serve.loadgen import run_load
    reqs, capped = workload_requests(tok, "alpaca", 6, seed=0, max_input_len=40,
                                     max_output_len=12)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) <= r.prompt_len
               for r in reqs)
    results, duration = asyncio.run(run_load(server.base_url, reqs, rate=50.0, seed=0))
    assert all(r.finished for r in results), [r.error for r in results]
    assert [r.num_output_tokens for r in results] == [q.max_tokens for q in reqs]
    for r, q in zip(results, reqs):
        assert 0 < r.ttft <= r.e2e_latency and len(r.itl) <= r.num_output_tokens - 1
        assert r.num_prompt_tokens == len(tok.encode(q.prompt))
    s = summarize(results, duration, ttft_slo=60.0)
    assert s["completed"] == 6 and s["request_goodput"] == pytest.approx(6 / duration)
    assert s["total_output_tokens"] == sum(q.max_tokens for q in reqs)


def test_client_summary_follows_the_vllm_definitions():
    from minillm.metrics import summarize
    from minillm.serve.loadgen import RequestResult, arrival_gaps
    a = RequestResult(10, ttft=0.5, itl=[0.1, 0.3], e2e_latency=0.9, num_output_tokens=3,
                      num_prompt_tokens=10, finished=True)
    b = RequestResult(20, ttft=2.0, itl=[], e2e_latency=2.0, num_output_tokens=1,
                      num_prompt_tokens=20, finished=True)
    c = RequestResult(5, error="boom")
    s = summarize([a, b, c], 4.0, ttft_slo=1.0, tpot_slo=0.25)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert b.tpot is None and s["tpot_mean"] == pytest.approx(0.2)  # (0.9 - 0.5) / 2; b: no gap
    assert s["itl_mean"] == pytest.approx(0.2)                 # pooled gaps
    assert s["request_goodput"] == pytest.approx(1 / 4.0)      # b misses the TTFT SLO
    assert s["output_throughput"] == pytest.approx(4 / 4.0)
    assert s["total_token_throughput"] == pytest.approx(34 / 4.0)
    assert RequestResult(7).num_prompt_tokens == 7             # no usage: the workload's count
    with pytest.raises(ValueError, match="pass duration="):
        summarize([a])                                         # the client must give its run time
    gaps = arrival_gaps(20000, rate=4.0, burstiness=0.5, seed=0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() > arrival_gaps(20000, rate=4.0, seed=0).std()   # burstier than Poisson
