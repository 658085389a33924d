"""Command line:
`python -m minillm generate "prompt" [--model M] [--max-tokens N] [--temperature T]`
`python -m minillm serve [--model M] [--port P]` (the chapter-08 server, minillm.serve.cli)
and `python -m minillm router --backend URL ...` (chapter 11, minillm.serve.router_cli).

Streams the reply token by token. Instruct models (a tokenizer with a chat template) get the prompt
wrapped as a user turn; `--raw` sends the text as it is.

Failures end in one line on stderr and a nonzero status, never a traceback: bad input (unknown
model or device, a model without a tokenizer, bad sampling values) exits 2, anything else 1
(set MINILLM_DEBUG=1 to see the traceback), Ctrl-C exits 130, and a reader that closes the pipe
early (`... | head -c 20`) ends the command quietly with 141, as SIGPIPE would.
"""
from __future__ import annotations

import argparse
import os
import sys

from .generate import generate_stream
from .loader import BUNDLED, has_tokenizer, load_model, resolve_device
from .sampling import SamplingParams


def prompt_ids(tok, text: str, raw: bool = False) -> list[int]:
    """Token ids of the prompt, wrapped as a user turn when the tokenizer has a chat template."""
    if raw or not getattr(tok, "chat_template", None):
        return tok.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(chat, add_special_tokens=False)     # the template already has its markers


def cmd_generate(args) -> int:
    # everything that can be checked cheaply is checked before the model is built
    device = resolve_device(args.device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    if not has_tokenizer(args.model):
        raise ValueError(f"{args.model} has no tokenizer (only {BUNDLED} and checkpoint "
                         "directories with tokenizer files have one); the command line needs "
                         f"one: use --model {BUNDLED} or a checkpoint directory")
    model, tok = load_model(args.model, weights=args.weights, device=device)
    ids = prompt_ids(tok, args.prompt, args.raw)
    new: list[int] = []
    shown = ""
    for token in generate_stream(model, tok, ids, args.max_tokens, params):
        if token == tok.eos_token_id:
            break
        new.append(token)
        text = tok.decode(new, skip_special_tokens=True)
        if not text.endswith("\ufffd"):                   # wait for a whole UTF-8 character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    sys.stdout.flush()                                    # a closed pipe shows up here, not at exit
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion for a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default=BUNDLED, help="preset name or local checkpoint directory")
    g.add_argument("--weights", default="pretrained", choices=["pretrained", "random"])
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    from .serve import cli as serve_cli                   # chapter 08; imports no web framework
    serve_cli.add_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    from .serve import router_cli                         # chapter 11
    router_cli.add_arguments(sub.add_parser("router", help="route requests over several servers"))
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve_cli.run(args)
        if args.command == "router":
            return router_cli.run(args)
        return cmd_generate(args)
    except KeyboardInterrupt:                  # Ctrl-C: stop quietly, as shells expect
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:                    # the reader went away (| head): nothing to say
        _drop_stdout()
        return 141
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:                     # noqa: BLE001 - one line, not a traceback
        if os.environ.get("MINILLM_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e} (set MINILLM_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again (the
    recipe of Python's `signal` documentation for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
