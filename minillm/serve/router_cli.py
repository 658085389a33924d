"""`python -m minillm router`: the chapter-11 router on the command line.

    python -m minillm router --host 127.0.0.1 --port 8000 --policy prefix_affinity \\
        --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002

Every backend is checked before the router listens (GET /v1/models must answer like an OpenAI
server); a wrong URL stops the router with a message naming it.
"""
from __future__ import annotations

from ..loader import BUNDLED
from .routing import POLICIES


def add_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeat once per replica)")
    p.add_argument("--policy", default="round_robin", choices=POLICIES)
    p.add_argument("--tokenizer", default=BUNDLED,
                   help="the backends' model, whose tokenizer prefix_affinity hashes with")
    p.add_argument("--block-size", type=int, default=16,
                   help="the backends' KV block size (prefix keys are per full block)")
    p.add_argument("--affinity-blocks", type=int, default=4,
                   help="how many leading full blocks decide a request's replica")
    p.add_argument("--balance-abs", type=int, default=4,
                   help="prefix_affinity falls back to the least-loaded replica when the owner "
                   "has more than this many requests in flight ...")
    p.add_argument("--balance-rel", type=float, default=2.0,
                   help="... and more than this times (the least-loaded replica's count + 1)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health probes of every backend (a backend that misses "
                   "3 in a row, 5 s each, is taken out; one marked down is taken back when it "
                   "answers)")
    p.add_argument("--log-level", default="warning")


def run(args) -> int:
    from .api_server import bind_socket, make_server
    from .router import Router, build_router, check_backend

    if not args.backend:
        raise ValueError("no backends: pass --backend URL once per replica, e.g. "
                         "--backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002")
    for url in args.backend:
        check_backend(url)
    tokenizer = None
    if args.policy == "prefix_affinity":
        from ..loader import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    kwargs = {}
    if args.policy == "prefix_affinity":
        kwargs = {"balance_abs": args.balance_abs, "balance_rel": args.balance_rel}
    router = Router(args.backend, args.policy, tokenizer=tokenizer, block_size=args.block_size,
                    affinity_blocks=args.affinity_blocks, health_interval=args.health_interval,
                    **kwargs)
    sock = bind_socket(args.host, args.port)
    make_server(build_router(router), 5.0, args.log_level).run(sockets=[sock])
    return 0
