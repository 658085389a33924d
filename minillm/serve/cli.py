"""`python -m minillm serve`: the OpenAI-compatible server on the command line (chapter 08).

    python -m minillm serve --model smollm2-135m --host 127.0.0.1 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8}'

The port is bound before the model loads, so a port in use fails at once with a message.

--max-num-batched-tokens bounds the tokens of one step, and a step's time is what every other
stream waits between two tokens. On a GPU 2048 tokens take milliseconds; on this course's CPU
a running stream waited 21.8 s while an 8k prompt prefilled in 2048-token chunks, so the CPU
default is CPU_MAX_NUM_BATCHED_TOKENS (see its measurement). Since chapter 12's attention work
(kernels/batched.py reads one sequence's consecutive blocks as a view, without masks) a step's
cost at a long context is mostly the chunk itself, so the stall falls with the budget.
"""
from __future__ import annotations

import sys

from ..loader import BUNDLED

GPU_MAX_NUM_BATCHED_TOKENS = 2048
# Measured 2026-11-24 (2 CPU cores shared with other work, load ~1.1; smollm2-135m, fp32,
# OMP_NUM_THREADS=1, --num-kv-blocks 640): the longest gap of a running stream while an
# 8000-token prompt prefills was 1.47 s at 64 (prefill 95 s) and 21.8 s at 2048 (prefill 64 s).
# Re-measured after chapter 12's attention changes (quiet, 2 threads, in-process:
# `python benchmarks/bench_stall.py --budgets 32 64 128 256`, benchmarks/results/
# stall_cpu_20261124_{before,after}.json): longest step at budget 32 / 64 / 128 / 256 near the
# end of the 8k prompt 0.49 / 0.70 / 1.27 / 2.17 s before, 0.32 / 0.48 / 0.89 / 1.62 s after.
# Through the server, as a streaming client sees it (quiet, server defaults otherwise:
# `python benchmarks/bench_stall_server.py`, benchmarks/results/stall_server_cpu_*20261124.json):
# the longest gap during the 8k prefill was 0.70 s at budget 64 (median 0.42 s, prefill 52 s)
# and 0.48 s at budget 32 with --max-num-seqs 32 (median 0.24 s, prefill 63 s). So the CPU
# defaults are 32 and 32 (the budget must cover one decode per running sequence).
CPU_MAX_NUM_BATCHED_TOKENS = 32
CPU_MAX_NUM_SEQS = 32
GPU_MAX_NUM_SEQS = 64
GAP_AT_CPU_DEFAULT = "0.48 s"
GAP_AT_GPU_DEFAULT_ON_CPU = "21.8 s"


def add_arguments(p) -> None:
    p.add_argument("--model", default=BUNDLED, help="preset name or local checkpoint directory")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: --model)")
    p.add_argument("--weights", default="pretrained", choices=["pretrained", "random"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: sized from memory)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences running at once (default: {GPU_MAX_NUM_SEQS} on a GPU, "
                   f"{CPU_MAX_NUM_SEQS} on the CPU, where each one's decode shares every step)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step (default: {GPU_MAX_NUM_BATCHED_TOKENS} on a GPU, "
                   f"{CPU_MAX_NUM_BATCHED_TOKENS} on the CPU, or --max-num-seqs if larger; on "
                   "the CPU one step's time is every other stream's stall: measured on 2 cores "
                   f"through the server while an 8k prompt prefills, {GAP_AT_CPU_DEFAULT} at "
                   f"{CPU_MAX_NUM_BATCHED_TOKENS}, 0.70 s at 64, {GAP_AT_GPU_DEFAULT_ON_CPU} at "
                   f"{GPU_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for a slot; more get 429")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 before they are parsed (default 1 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info")


def run(args) -> int:
    from ..engine import LLMEngine
    from ..loader import load_model
    from .api_server import MAX_BODY_BYTES, bind_socket, run_server
    from .serving import max_model_len

    body_limit = MAX_BODY_BYTES if args.max_request_body_bytes is None \
        else args.max_request_body_bytes
    if body_limit < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {body_limit}")
    sock = bind_socket(args.host, args.port)          # fail fast, before loading the model
    model, tok = load_model(args.model, weights=args.weights, device=args.device)
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer; the server needs one")
    on_gpu = model.device.type == "cuda"
    seqs = (args.max_num_seqs if args.max_num_seqs is not None
            else GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS)
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = (GPU_MAX_NUM_BATCHED_TOKENS if on_gpu
                  else max(CPU_MAX_NUM_BATCHED_TOKENS, seqs))             # each decodes
    engine = LLMEngine(model, tok, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                       max_num_seqs=seqs, max_num_batched_tokens=budget,
                       enable_chunked_prefill=not args.no_chunked_prefill,
                       enable_prefix_caching=not args.no_prefix_caching)
    usable, ctx = max_model_len(engine), model.config.max_position_embeddings
    if usable < ctx:
        print(f"note: the KV pool holds {engine.num_kv_blocks} blocks ({usable} tokens), less "
              f"than the context of {ctx}; a request (prompt + max_tokens) may use {usable} "
              f"tokens (/v1/models says max_model_len {usable}); raise --num-kv-blocks to "
              f"{-(-ctx // args.block_size)} to serve full contexts", file=sys.stderr)
    run_server(engine, args.served_model_name or args.model, sock, max_waiting=args.max_waiting,
               drain_timeout=args.drain_timeout, log_level=args.log_level,
               max_body_bytes=body_limit)
    return 0
