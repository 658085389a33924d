"""Serving (chapter 08): the engine behind an OpenAI-compatible HTTP API.

    protocol.py       request bodies (pydantic) and OpenAI-style error bodies
    async_engine.py   the engine thread, per-request events (TextDelta, Finished, Failed,
                      Aborted), incremental detokenising
    metrics.py        Prometheus metrics (TTFT, ITL, e2e, queue, KV blocks, preemptions, ...)
    serving.py        OpenAIServing: check, admit, answer or stream one request, usage
    api_server.py     the FastAPI app (thin routes), `run_server`, `BackgroundServer`
    cli.py            `python -m minillm serve --model smollm2-135m --port 8000`

The modules import FastAPI and uvicorn; `import minillm` does not import this package.
"""
