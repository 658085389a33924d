"""Serving (chapter 08): the engine behind an OpenAI-compatible HTTP API.

    protocol.py       request bodies (pydantic) and OpenAI-style error bodies
    async_engine.py   the engine thread, per-request events (TextDelta, Finished, Failed,
                      Aborted), incremental detokenising
    metrics.py        Prometheus metrics (TTFT, ITL, e2e, queue, KV blocks, preemptions, ...)
    serving.py        OpenAIServing: check, admit, answer or stream one request (or a list
                      of prompts x n samples), usage; /tokenize, /detokenize, /tokenizer_info
    logprobs.py       logprobs in the completions and chat wire shapes
    api_server.py     the FastAPI app (thin routes), `run_server`, `BackgroundServer`
    cli.py            `python -m minillm serve --model smollm2-135m --port 8000`

What clients may send (vLLM's names): n, prompt lists and token-id prompts, echo, logprobs
(completions 0..20; chat logprobs + top_logprobs), best_of == n, presence / frequency /
repetition penalties, min_p, top_k, response_format text / json_object / json_schema,
guided_json / guided_regex / guided_choice, stream_options include_usage and
continuous_usage_stats; store / metadata / service_tier / parallel_tool_calls are accepted and
change nothing. Tools, functions, logit_bias and suffix are a 400. `make test-clients` runs
openai, langchain-openai, llm, litellm, guidellm and lm-eval against the server.

The modules import FastAPI and uvicorn; `import minillm` does not import this package.
"""
