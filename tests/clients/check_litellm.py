"""litellm (the OpenAI-compatible provider) against minillm."""
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # offline: no cost-map fetch
import litellm  # noqa: E402

from common import BASE, MODEL, check  # noqa: E402

C = "litellm"
KW = dict(model="openai/" + MODEL, api_base=BASE + "/v1", api_key="none")


@check(C, "completion")
def _():
    r = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, **KW)
    return repr(r.choices[0].message.content)


@check(C, "stream")
def _():
    parts = [ch.choices[0].delta.content or "" for ch in litellm.completion(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True, **KW)]
    return repr("".join(parts))


@check(C, "n=2")
def _():
    r = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2,
                           temperature=1.0, **KW)
    assert len(r.choices) == 2
    return "2 choices"


@check(C, "text_completion")
def _():
    r = litellm.text_completion(prompt="Once upon a time", max_tokens=6, **KW)
    return repr(r.choices[0].text)
