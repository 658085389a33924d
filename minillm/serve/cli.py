"""`python -m minillm serve`: the OpenAI-compatible server on the command line (chapter 08).

    python -m minillm serve --model smollm2-135m --host 127.0.0.1 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8}'

The port is bound before the model loads, so a port in use fails at once with a message.
"""
from __future__ import annotations

from ..loader import BUNDLED


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
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for a slot; more get 429")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info")


def run(args) -> int:
    from ..engine import LLMEngine
    from ..loader import load_model
    from .api_server import bind_socket, run_server

    sock = bind_socket(args.host, args.port)          # fail fast, before loading the model
    model, tok = load_model(args.model, weights=args.weights, device=args.device)
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer; the server needs one")
    engine = LLMEngine(model, tok, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_chunked_prefill=not args.no_chunked_prefill,
                       enable_prefix_caching=not args.no_prefix_caching)
    run_server(engine, args.served_model_name or args.model, sock, max_waiting=args.max_waiting,
               drain_timeout=args.drain_timeout, log_level=args.log_level)
    return 0
