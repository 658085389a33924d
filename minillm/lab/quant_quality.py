"""What quantization costs in quality, measured (chapter 09).

Four numbers compare a quantized model with the unquantized one on the same offline text:

    perplexity      exp(mean negative log-likelihood of the text's next tokens): the absolute
                    quality; a change of a few percent is visible, but it averages away
                    disagreements that cancel
    mean KL         KL(p_ref || p_quant) of the next-token distributions, averaged over positions:
                    how far the quantized model's predictions moved, whatever the text
    top-1 agreement the fraction of positions where both models rank the same token first
    greedy match    greedy generation from several prompts: new tokens until the first token that
                    differs (the number a user notices: when does the text change?)

The text is the course's own prose, frozen: `texts/quant_eval.md` is the package map
(minillm/README.md) as it stood on 2026-11-24, and `texts/quant_calibration.md`, GPTQ's
calibration text, the grading and drill READMEs of the same day. Copies, not the live files:
the live READMEs keep changing, and a perplexity measured on one version of a text cannot be
compared with one measured on another (the package map's first 1,024 tokens gave the fp32
model a perplexity of 83.0 on 11-24 and 88.2 a day later). The evaluation text is never the
calibration text.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parents[1]
EVAL_FILES = ("lab/texts/quant_eval.md",)                      # minillm/README.md, 2026-11-24
CALIBRATION_FILES = ("lab/texts/quant_calibration.md",)        # grading + drill READMEs, 11-24


def _token_block(tok, files, num_seqs: int, seq_len: int) -> torch.Tensor:
    text = "\n\n".join((PACKAGE / f).read_text() for f in files)
    ids = tok.encode(text)
    if len(ids) < num_seqs * seq_len:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than {num_seqs} x {seq_len}")
    return torch.tensor(ids[:num_seqs * seq_len]).view(num_seqs, seq_len)   # [S, T]


def eval_ids(tok, num_seqs: int = 4, seq_len: int = 256) -> torch.Tensor:
    return _token_block(tok, EVAL_FILES, num_seqs, seq_len)


def calibration_ids(tok, num_seqs: int = 8, seq_len: int = 128) -> torch.Tensor:
    return _token_block(tok, CALIBRATION_FILES, num_seqs, seq_len)


def prompts(tok, num: int = 8, length: int = 12) -> list:
    """Greedy-generation prompts: `num` slices of `length` tokens spread over the eval text."""
    ids = eval_ids(tok, 1, 4 * 256)[0].tolist()
    step = (len(ids) - length) // num
    return [ids[i * step:i * step + length] for i in range(num)]


@dataclass
class Quality:
    perplexity: float
    mean_kl: float
    top1_agreement: float
    greedy_match_tokens: float          # mean new tokens before the first difference
    greedy_identical: int               # prompts whose whole continuation matched
    num_prompts: int
    max_new_tokens: int
    num_positions: int

    def row(self) -> dict:
        return asdict(self)


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """[S, T] -> next-token log-probabilities [S, T, V] (float32), one sequence at a time."""
    return torch.cat([model(row[None]).float().log_softmax(-1) for row in ids])


def matching_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy(model, prompt_ids: list, max_new_tokens: int) -> list:
    from minillm import SamplingParams, generate
    return generate(model, None, torch.tensor(prompt_ids), max_new_tokens=max_new_tokens,
                    sampling=SamplingParams(temperature=0.0, ignore_eos=True))


def compare(ref_logp: torch.Tensor, ids: torch.Tensor, model, ref_greedy: list,
            prompt_list: list, max_new_tokens: int) -> Quality:
    """Quality of `model` against the reference's log-probs and greedy outputs on the same ids."""
    outs = [greedy(model, p, max_new_tokens) for p in prompt_list]
    return score(ref_logp, log_probs(model, ids), ids, ref_greedy, outs, max_new_tokens)


def score(ref_logp, logp, ids, ref_greedy: list, outs: list, max_new_tokens: int) -> Quality:
    """The four numbers from log-probs [S, T, V] of both sides and greedy token lists."""
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).float().mean()
    runs = [matching_prefix(r, o) for r, o in zip(ref_greedy, outs)]
    return Quality(perplexity=float(nll.exp()), mean_kl=float(kl), top1_agreement=float(top1),
                   greedy_match_tokens=sum(runs) / len(runs),
                   greedy_identical=sum(r == max_new_tokens for r in runs),
                   num_prompts=len(runs), max_new_tokens=max_new_tokens,
                   num_positions=ids.numel())


def quality_table(ref_model, variants: dict, tok, num_seqs: int = 4, seq_len: int = 256,
                  num_prompts: int = 8, max_new_tokens: int = 32) -> dict:
    """{name: Quality} for each model of `variants` ({name: model}), the reference included as
    "reference" (its KL is 0 and its agreements are perfect by construction)."""
    ids = eval_ids(tok, num_seqs, seq_len)
    ref_logp = log_probs(ref_model, ids)
    plist = prompts(tok, num_prompts)
    ref_greedy = [greedy(ref_model, p, max_new_tokens) for p in plist]
    table = {"reference": compare(ref_logp, ids, ref_model, ref_greedy, plist, max_new_tokens)}
    for name, model in variants.items():
        table[name] = compare(ref_logp, ids, model, ref_greedy, plist, max_new_tokens)
    return table


# --- the KV cache in fewer bits: the engine's own paged path, fp32 pool vs fp8 pool ----------
@torch.no_grad()
def paged_log_probs(model, ids: torch.Tensor, kv_cache_dtype: str = "auto",
                    block_size: int = 16) -> torch.Tensor:
    """[S, T] -> [S, T, V] through a paged cache of `kv_cache_dtype`: every query attends to
    the keys and values as the pool stores them (rounded to fp8 for "fp8"), as in the engine."""
    from minillm.cache.paged import SimplePagedKVCache
    rows = []
    for row in ids:
        cache = SimplePagedKVCache(model.config, -(-row.numel() // block_size), block_size,
                                   batch_size=1, dtype=model.dtype, device=model.device,
                                   kv_cache_dtype=kv_cache_dtype)
        rows.append(model(row[None], cache=cache).float().log_softmax(-1))
    return torch.cat(rows)


def engine_greedy(model, prompt_list: list, max_new_tokens: int, kv_cache_dtype: str) -> list:
    """Greedy continuations from the engine (LLM) with this KV cache dtype."""
    from minillm import LLM, SamplingParams
    llm = LLM((model, None), kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_list, sp, use_tqdm=False)]


def kv_quality_table(model, tok, kv_cache_dtypes=("fp8",), num_seqs: int = 4,
                     seq_len: int = 256, num_prompts: int = 8, max_new_tokens: int = 32) -> dict:
    """{kv_cache_dtype: Quality} against the same model with its own-dtype pool ("auto"),
    all through the paged cache and the engine."""
    ids = eval_ids(tok, num_seqs, seq_len)
    plist = prompts(tok, num_prompts)
    ref_logp = paged_log_probs(model, ids, "auto")
    ref_greedy = engine_greedy(model, plist, max_new_tokens, "auto")
    table = {"auto": score(ref_logp, ref_logp, ids, ref_greedy, ref_greedy, max_new_tokens)}
    for d in kv_cache_dtypes:
        table[d] = score(ref_logp, paged_log_probs(model, ids, d), ids, ref_greedy,
                         engine_greedy(model, plist, max_new_tokens, d), max_new_tokens)
    return table
