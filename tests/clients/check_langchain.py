"""langchain-openai's ChatOpenAI against minillm."""
import jsonschema
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from common import BASE, MODEL, check

C = "langchain-openai"
llm = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=12,
                 temperature=0, max_retries=0, timeout=120)


@check(C, "invoke")
def _():
    return repr(llm.invoke("Say hello").content)


@check(C, "stream with usage")
def _():
    chunks = list(llm.stream("Count to five", stream_usage=True))
    usage = [ch.usage_metadata for ch in chunks if ch.usage_metadata]
    assert usage and usage[-1]["output_tokens"] > 0, usage
    return f"{len(chunks)} chunks, usage {usage[-1]}"


@check(C, "batch")
def _():
    outs = llm.batch(["Hi", "Hello", "Hey"])
    assert len(outs) == 3
    return " | ".join(repr(o.content[:20]) for o in outs)


@check(C, "n=2")
def _():
    res = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=6, n=2,
                     temperature=1.0, max_retries=0).generate([[HumanMessage("Hi")]])
    assert len(res.generations[0]) == 2
    return f"{len(res.generations[0])} generations"


@check(C, "with_structured_output json_schema")
def _():
    schema = {"title": "City", "type": "object",
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    out = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=60,
                     max_retries=0).with_structured_output(schema, method="json_schema").invoke(
        "Name a city and its population")
    jsonschema.validate(out, schema)
    return str(out)
