"""`minillm.LLM`: offline batch generation on top of LLMEngine (vLLM's `LLM` class).

    llm = minillm.LLM("smollm2-135m")
    outs = llm.generate(["Hello", "The capital of France is"],
                        minillm.SamplingParams(temperature=0.0, max_tokens=16))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].metrics.ttft

Outputs come back in prompt order, one RequestOutput per prompt. With SamplingParams.n > 1 the
samples are in `outs[i].outputs` (a list of n CompletionOutputs); `outs[i].text` etc. are the
first sample's. A prompt the engine refuses (empty, longer than the context, can never fit in
the KV pool, ...) gets finish_reason "error" and the reason in `outs[i].error`; the other
prompts are unaffected. The same holds for a request that fails while it runs (its forward,
sampling, stop check or detokenisation raised): finish_reason "error", the reason in `.error`.
Invalid arguments to `generate` itself (a list of SamplingParams of the wrong length) raise
ValueError. An interrupted `generate` (Ctrl-C) aborts its own requests before re-raising.

Prefix caching is on by default (as in vLLM) and lives across generate() calls;
`outs[i].num_cached_tokens` says how many prompt tokens came from the cache. A prompt may be a
dict {"prompt": text or "prompt_token_ids": ids, "cache_salt": "tenant-a"} (vLLM's form): only
requests with the same salt share cached prefixes.
"""
from __future__ import annotations

import itertools
import operator
from typing import Optional, Sequence, Union

import torch

from ..cache.paged import resolve_kv_cache_dtype
from ..loader import load_model, resolve_device, resolve_dtype
from ..sampling import SamplingParams
from .cuda_graphs import check_enforce_eager
from .llm_engine import LLMEngine
from .outputs import RequestOutput


def _is_token_id(x) -> bool:
    if isinstance(x, (bool, str, bytes)):
        return False
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


def as_prompt_list(prompts) -> list:
    """What `LLM.generate` was given -> a list of prompts (each a string, ids, a tensor or a
    dict with "cache_salt")."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, torch.Tensor) or (hasattr(prompts, "__array__")
                                             and hasattr(prompts, "ndim")):
        if prompts.ndim <= 1:
            return [prompts]                     # one prompt of token ids, as minillm.generate
        if prompts.ndim == 2:
            return list(prompts)                 # one prompt per row
        raise ValueError(f"a tensor of prompts must be 1-D (one prompt) or 2-D (one per row), "
                         f"got shape {tuple(prompts.shape)}")
    prompts = list(prompts)
    if prompts and _is_token_id(prompts[0]):
        return [prompts]                         # a list of ids is ONE prompt
    return prompts


class LLM:
    """model: a name or directory for `minillm.load_model`, or a `(model, tokenizer)` pair, or a
    Transformer (with `tokenizer=`). num_kv_blocks=None sizes the KV pool from memory (see
    `minillm.engine.model_runner.CUDA_KV_FRACTION` and `CPU_KV_BYTES`). dtype: None or "auto"
    (bf16 or fp16 on a GPU, fp32 on a CPU), or e.g. "bfloat16": on a CPU with native bf16
    (AVX512_BF16 or AMX) that halves the bytes every step reads; fp32 stays the CPU default
    because it is what the tests compare with transformers. kv_cache_dtype: "auto" (the
    model's dtype) or "fp8" (e4m3, one byte per value: twice bf16's tokens per GB; also
    "fp8_e4m3", "fp8_e5m2"), vLLM's names. enforce_eager=False replays decode
    steps from CUDA graphs on a GPU (`minillm.engine.cuda_graphs`) and, on a CPU, runs each
    step through one torch.compile'd graph (`minillm.engine.compiled`; the first steps of each
    shape compile, tens of seconds). The default stays True (vLLM's is False): CI has no GPU to
    test graphs on every change (measured once on an H100: benchmarks/README.md), and a short
    CPU script would spend longer compiling than it saves.

    tensor_parallel_size=N (chapter 10) splits the model over N ranks: N - 1 worker processes
    (spawned once, gloo on the CPU) and rank 0 in this process, which samples. N must split the
    heads (ValueError names the sizes that work). A script that uses it needs the usual
    `if __name__ == "__main__":` guard, because spawned workers import the main module.
    `shutdown()` (or `del llm`, or interpreter exit) stops them.

    pipeline_parallel_size=P (chapter 10) cuts the layers into P contiguous stages: stage 0
    (the embedding and the first layers) runs in this process, which also schedules and
    samples; stages 1 .. P - 1 are worker processes, each with a KV pool for its own layers,
    and hidden states go stage to stage with gloo send / recv. Each step's requests are cut
    into m micro-batches (m = P unless `llm.engine.executor.num_micro_batches` is set) so the
    stages overlap. P must not exceed the number of layers; tp and pp together, speculative
    decoding, quantization, KV transfer and an fp8 KV cache are refused with P > 1."""

    def __init__(self, model="smollm2-135m", tokenizer=None, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, scheduling: str = "continuous",
                 preemption: str = "recompute", num_cpu_blocks: Optional[int] = None,
                 device=None, dtype=None, clock=None, speculative_config=None,
                 quantization: Optional[str] = None, kv_transfer_config=None,
                 kv_cache_dtype: str = "auto", enforce_eager: bool = True,
                 scheduling_policy: str = "fcfs", tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1):
        self.engine = None                   # shutdown() / __del__ work whatever fails below
        check_enforce_eager(enforce_eager)   # chapter 12; checked before loading anything
        check_parallel(tensor_parallel_size, pipeline_parallel_size, speculative_config,
                       quantization, kv_transfer_config)
        if speculative_config is not None:   # fail before loading anything
            from .spec_decode import parse_speculative_config
            parse_speculative_config(speculative_config)
        if quantization is not None:         # chapter 09; checked before loading anything
            from ..quant import check_quantization
            check_quantization(quantization)
        resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)   # "auto" | "fp8": checked early
        if isinstance(model, tuple):
            model, tokenizer = model
        elif isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            model, tok = load_model(model, device=device, dtype=dtype, quantization=quantization)
            tokenizer = tokenizer if tokenizer is not None else tok
            quantization = None              # done by load_model
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ValueError("model must be a name for minillm.load_model, a (model, tokenizer) "
                             f"pair or a minillm Transformer, got {type(model).__name__}")
        if device is not None or dtype is not None:
            device = model.device if device is None else resolve_device(device)
            model = model.to(device=device, dtype=resolve_dtype(dtype or model.dtype, device))
        if quantization is not None:         # a model object given: quantize it in place
            from ..quant import quantize_model
            quantize_model(model, quantization)
        self.model, self.tokenizer = model, tokenizer
        self.engine = LLMEngine(model, tokenizer, block_size=block_size,
                                num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks,
                                max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                enable_chunked_prefill=enable_chunked_prefill,
                                enable_prefix_caching=enable_prefix_caching,
                                scheduling=scheduling, preemption=preemption, clock=clock,
                                speculative_config=speculative_config,
                                kv_transfer_config=kv_transfer_config,
                                kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
                                scheduling_policy=scheduling_policy,
                                tensor_parallel_size=tensor_parallel_size,
                                pipeline_parallel_size=pipeline_parallel_size)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor- or pipeline-parallel worker processes (nothing to do with one
        rank). Also run by `del llm` and at interpreter exit."""
        if self.engine is not None:
            self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:                    # noqa: BLE001 - never raise from __del__
            pass

    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams],
                                                       None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None) -> list:
        """prompts: a string, a list of strings, a list of token ids (one prompt), a list of
        token-id lists, or a tensor / numpy array of ids (1-D: one prompt; 2-D: one per row);
        a prompt may also be a dict with "prompt" or "prompt_token_ids" and "cache_salt".
        sampling_params: one for all prompts or a list with one per prompt. priority: one int per
        prompt, with scheduling_policy="priority" (lower runs first; vLLM's argument). Returns
        [RequestOutput] in order. If generate is interrupted (Ctrl-C, any exception), it aborts
        its own requests, so the engine holds no blocks for them, and re-raises."""
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "pass one SamplingParams or exactly one per prompt")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass "
                             "one per prompt (scheduling_policy='priority': lower runs first)")
        ids, results, bar = [], {}, None
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                rid = str(next(self._ids))
                ids.append(rid)
                try:
                    prompt, salt = split_prompt(prompt)
                    self.engine.add_request(rid, prompt, p, cache_salt=salt, priority=prio)
                except Exception as e:                   # this request only, whatever it was
                    msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                    results[rid] = RequestOutput.failed(rid, prompt, msg)
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)
            bar.update(len(results))
            pending = set(ids) - set(results)
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.engine.release([r for r in ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name); returns how many blocks were dropped.

        Call it whenever the weights change (a new checkpoint, an RL update, a LoRA merged in):
        a cached block holds K/V computed by the OLD weights and its key names only the tokens,
        so without a flush the next request with that prefix reuses stale K/V. Also used to time
        a cold start. Refused while requests run: their blocks stay cached and keyed, so the
        flush would be partial; finish or abort them first (vLLM refuses then too)."""
        if self.engine.scheduler.has_unfinished():
            raise ValueError("reset_prefix_cache while requests are running would keep their "
                             "blocks cached; finish them (or llm.abort(request_id)) first")
        return self.engine.reset_prefix_cache()

    def abort(self, request_id: str) -> bool:
        """Abort a request added through `self.engine.add_request` (generate() blocks, so its own
        requests finish before it returns)."""
        return self.engine.abort_request(request_id)


def check_parallel(tp, pp, speculative_config, quantization, kv_transfer_config) -> None:
    """ValueError for parallel sizes this engine cannot run (chapter 10); the heads are checked
    against tp once the model is known (minillm.parallel.check_tp_size)."""
    for name, n in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    if tp > 1 and pp > 1:
        raise ValueError(f"tensor_parallel_size={tp} with pipeline_parallel_size={pp} is not "
                         "built: use one of them (the other = 1)")
    for name, n in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if n > 1 and (speculative_config or quantization or kv_transfer_config):
            raise ValueError(f"{name} > 1 runs without speculative_config, quantization and "
                             f"kv_transfer_config; drop them or use {name}=1")


def split_prompt(prompt):
    """vLLM's dict prompt {"prompt" | "prompt_token_ids", "cache_salt"} -> (prompt, cache_salt)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids' and "
                         f"may add 'cache_salt'; got keys {sorted(prompt)}")
    text = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    return text, prompt.get("cache_salt")
