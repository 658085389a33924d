"""The chapter-00 generation loop: prefill once, then decode one token at a time.

`generate` uses the contiguous KV cache, so each decode step computes one new token's q/k/v and
attends over everything cached: O(N) work per sequence of N tokens in total (per layer, ignoring
attention's own O(N) reads). `generate_no_cache` re-runs the whole sequence every step: O(N^2).
Both give the same tokens under greedy decoding; chapter 01 times the difference.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from .cache.contiguous import ContiguousKVCache
from .sampling import SamplingParams, make_generator, sample

Prompt = Union[str, Sequence[int], torch.Tensor]


def prompt_token_ids(prompt: Prompt, tok, vocab_size: int) -> list[int]:
    """A prompt (text, a list of ids or a tensor of ids) -> validated token ids."""
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        ids = tok.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.flatten().tolist()
    elif hasattr(prompt, "__array__") and hasattr(prompt, "ndim"):   # a numpy array of ids
        ids = torch.as_tensor(prompt).flatten().tolist()
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")
    if len(ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    try:
        ids = [operator.index(t) for t in ids]            # ints, numpy ints; not floats
    except TypeError:
        ids = None
    if ids is None or not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); check the "
                         "tokenizer matches the model")
    return ids


def encode_prompt(model, tok, prompt: Prompt) -> torch.Tensor:
    """A prompt -> input_ids [1, T] on the model's device, validated."""
    ids = prompt_token_ids(prompt, tok, model.config.vocab_size)
    return torch.tensor([ids], dtype=torch.long, device=model.device)


def check_context_room(cfg, prompt_len: int, max_tokens: int, arg: str = "max_new_tokens") -> None:
    """The prompt plus `max_tokens` new tokens must fit the model's context (`arg` names the
    knob)."""
    ctx = cfg.max_position_embeddings
    if prompt_len >= ctx:
        raise ValueError(f"prompt has {prompt_len} tokens but {cfg.name}'s context is "
                         f"{ctx}; shorten the prompt to at most {ctx - 1} tokens")
    if prompt_len + max_tokens > ctx:
        raise ValueError(f"prompt ({prompt_len}) + {arg} ({max_tokens}) exceeds "
                         f"the context of {ctx}; lower {arg} to {ctx - prompt_len}")


def _check_room(model, prompt_len: int, max_new_tokens: int) -> None:
    if int(max_new_tokens) != max_new_tokens or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    check_context_room(model.config, prompt_len, max_new_tokens)


@dataclass(frozen=True)
class Stop:
    """Why a sequence stops: reason "stop" (a stop token or stop string) or "length"."""
    reason: str
    stop: object = None                 # the stop token id or stop string that matched
    text_cut: Optional[int] = None      # with a stop string: len of the text before it


def stop_reason(params: SamplingParams, output_token_ids: list, eos_token_id: Optional[int] = None,
                max_tokens: Optional[int] = None, decode=None) -> Optional[Stop]:
    """The one stop rule (this loop, the engine and the batch-1 speculative loop), checked after
    each new token: a stop token (EOS unless ignore_eos, or one of stop_token_ids), then a stop
    string in the decoded text (only when `decode(ids) -> str` is given), then the length limit
    (max_tokens, default params.max_tokens). None: keep going."""
    token = output_token_ids[-1]
    if token in params.stop_token_ids or (not params.ignore_eos and token == eos_token_id):
        return Stop("stop", token)
    if params.stop and decode is not None:
        text = decode(output_token_ids)
        hits = [(text.find(s), s) for s in params.stop if s in text]
        if hits:
            cut, s = min(hits)
            return Stop("stop", s, cut)
    if len(output_token_ids) >= (max_tokens if max_tokens is not None else params.max_tokens):
        return Stop("length")
    return None


def eos_token_id(tok) -> Optional[int]:
    return getattr(tok, "eos_token_id", None) if tok is not None else None


@torch.inference_mode()
def generate_stream(model, tok, prompt: Prompt, max_new_tokens: int = 32,
                    sampling: Optional[SamplingParams] = None) -> Iterator[int]:
    """Yield new token ids one at a time (prefill, then one decode step per token)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    input_ids = encode_prompt(model, tok, prompt)             # [1, T]
    T = input_ids.shape[1]
    _check_room(model, T, max_new_tokens)
    cache = ContiguousKVCache(model.config, batch_size=1, max_len=T + max_new_tokens - 1,
                              dtype=model.dtype, device=model.device)
    gen = make_generator(sampling.seed, model.device)
    eos = eos_token_id(tok)
    logits = model(input_ids, cache=cache, last_only=True)    # prefill: [1, 1, V]
    out: list[int] = []
    while True:
        next_id = sample(logits[:, -1], sampling, gen)        # [1]
        out.append(int(next_id))
        yield out[-1]
        if stop_reason(sampling, out, eos, max_new_tokens):
            return
        logits = model(next_id[:, None], cache=cache)         # decode: one token in, [1, 1, V]


def generate(model, tok, prompt: Prompt, max_new_tokens: int = 32,
             sampling: Optional[SamplingParams] = None) -> list[int]:
    """The new tokens (not the prompt), stopping at EOS unless `sampling.ignore_eos`."""
    return list(generate_stream(model, tok, prompt, max_new_tokens, sampling))


@torch.inference_mode()
def generate_no_cache(model, tok, prompt: Prompt, max_new_tokens: int = 32,
                      sampling: Optional[SamplingParams] = None) -> list[int]:
    """The same loop without a KV cache: every step recomputes the whole sequence."""
    sampling = sampling or SamplingParams(temperature=0.0)
    ids = encode_prompt(model, tok, prompt)
    _check_room(model, ids.shape[1], max_new_tokens)
    gen = make_generator(sampling.seed, model.device)
    eos = eos_token_id(tok)
    new: list[int] = []
    while True:
        logits = model(ids, last_only=True)                   # [1, 1, V], all tokens recomputed
        next_id = sample(logits[:, -1], sampling, gen)
        new.append(int(next_id))
        if stop_reason(sampling, new, eos, max_new_tokens):
            break
        ids = torch.cat([ids, next_id[:, None]], dim=1)
    return new
