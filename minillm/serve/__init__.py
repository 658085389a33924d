"""Serving (chapter 08): the engine behind an OpenAI-compatible HTTP API.

    protocol.py       request bodies (pydantic) and OpenAI-style error bodies
    async_engine.py   the engine thread, per-request event queues, incremental detokenising
    metrics.py        Prometheus metrics (TTFT, ITL, e2e, queue, KV blocks, preemptions, ...)
    api_server.py     the FastAPI app, `run_server`, `BackgroundServer` (a server in a thread)
    cli.py            `python -m minillm serve --model smollm2-135m --port 8000`

The modules import FastAPI and uvicorn; `import minillm` does not import this package.
"""
