"""Structured outputs: a grammar turned into a token mask at every step (chapter 08).

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\\d{3}-\\d{4}"))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

A grammar (a JSON schema, a regex, a list of choices) describes a set of strings. Decoding under
it keeps a parser state per request; at each step the parser says which tokens of the
vocabulary may come next without leaving the set (a bit per token: the MASK), the runner sets
every other logit to -inf before sampling, and the sampled token advances the parser:

    step    parser state          allowed next tokens             sampled
    0       start                 '{'  '{"'                        '{"'
    1       in a key              'name'  'n'  'na' ...            'name'
    2       after the key         '":'  '": '  '"'                 '":'
    ...     accepting             '}' and EOS                      EOS -> stop

The parser is llguidance (Microsoft's, Rust, no dependencies; what vLLM offers as
`guidance`): it compiles JSON schemas, regexes and Lark grammars against the tokenizer's own
vocabulary once, then computes a mask in tens of microseconds. A grammar only constrains the
SHAPE: `{"age": 999}` validates against {"type": "integer"} whatever the true age is.

The engine (chapter 04) knows nothing of this file: every Request carries a grammar whose
`allowed(V)` returns None and whose `accept(t)` does nothing (request.py's NoGrammar) until a
request asks for structured output; then `StructuredOutputManager.grammar` builds a
`GrammarMatcher` here. Speculative decoding is turned off for such requests (their drafts are
not proposed): a draft token would have to be checked against the grammar state after the
tokens before it, which the one-token seam does not carry.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import torch

from ..sampling import StructuredOutputsParams


# compact JSON (", " and ": " separators, no free whitespace): a small model given free
# whitespace tends to wander in newlines; a schema's own "x-guidance" options override this
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for one StructuredOutputsParams."""
    from llguidance import LLMatcher, grammar_from
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {schema!r:.80}")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    return grammar_from("choice", list(so.choice))


class GrammarMatcher:
    """One request's parser: the mask of allowed next tokens, advanced by each sampled token."""
    active = True

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens that keep the output inside the grammar (EOS only once
        it is complete). ValueError if the parser failed or allows nothing."""
        m = self.matcher
        if m.is_error():
            raise ValueError(f"the grammar failed: {m.get_error()}")
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if m.is_error():                                     # e.g. nothing can follow
            raise ValueError("no token sequence can continue the output inside the grammar ("
                             f"{m.get_error().splitlines()[0]})")
        mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if len(mask) < vocab_size:                           # ids past the tokenizer: never
            mask = np.concatenate([mask, np.zeros(vocab_size - len(mask), dtype=bool)])
        if not mask.any():
            raise ValueError("the grammar allows no next token (no token sequence can continue "
                             "the output inside it)")
        return torch.from_numpy(mask)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} is outside the grammar: {self.matcher.get_error()}")

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self.matcher.deep_copy(), self.vocab_size)


class StructuredOutputManager:
    """Compiles grammars for one tokenizer (vLLM's name). The tokenizer's llguidance view is
    built on the first grammar (about a second) and kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: Optional[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lltok = None

    def lltokenizer(self):
        if self._lltok is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            try:
                import llguidance.hf
            except ImportError:
                raise ValueError("structured outputs need llguidance: pip install llguidance"
                                 ) from None
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=self.eos_token_id)
        return self._lltok

    def grammar(self, so: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher, or ValueError naming what is wrong with the grammar (an invalid
        schema or regex, or one that no token sequence can match)."""
        from llguidance import LLMatcher
        lltok = self.lltokenizer()
        text = grammar_text(so)
        problem = LLMatcher.validate_grammar(text, lltok)
        if problem:
            raise ValueError(f"invalid structured output grammar: {problem.strip()}")
        g = GrammarMatcher(LLMatcher(lltok, text, log_level=0), self.vocab_size)
        if g.matcher.is_error():
            raise ValueError(f"invalid structured output grammar: {g.matcher.get_error()}")
        g.allowed(self.vocab_size)           # raises if no token can even start the output
        return g


__all__ = ["StructuredOutputManager", "GrammarMatcher", "grammar_text"]
