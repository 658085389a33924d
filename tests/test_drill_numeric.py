"""Every numeric generator's answer equals an arithmetic recomputation written here by hand from
the drawn parameters (model shapes from minillm.configs, GPU datasheet figures), for many seeds;
and the formulas behind them against independent references (simulation, minillm's BlockManager).
The speculative-decoding and Little's-law answers come from minillm.spec.theory and
minillm.lab.capacity (the drill calls them, it keeps no copies)."""
import math
import random

import pytest
import torch

from minillm import configs, drill, kvmath
from minillm.cache.blocks import BlockManager
from minillm.drill import formulas, generators
from minillm.lab import capacity
from minillm.spec import theory

SEEDS = range(25)
BYTES = {"bfloat16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def kv_token(name, dtype="bfloat16"):
    c = configs.get(name)
    if c.kv_lora_rank:
        return c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * BYTES[dtype]
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * BYTES[dtype]


def params(name):
    c = configs.get(name)
    if c.kv_lora_rank:
        return c.published_params
    h, d = c.hidden_size, c.head_dim
    q_o = 2 * h * c.num_heads * d
    k_v = 2 * h * c.num_kv_heads * d
    bias = (c.num_heads * d + 2 * c.num_kv_heads * d) if c.attention_bias else 0
    layer = q_o + k_v + bias + 3 * h * c.intermediate_size + 2 * h
    emb = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * layer + emb + h


def read_params(name):                    # a step reads all weights but the untied input embedding
    c = configs.get(name)
    return params(name) - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)


def matmul_params(name):
    c = configs.get(name)
    h, d = c.hidden_size, c.head_dim
    return c.num_layers * (2 * h * c.num_heads * d + 2 * h * c.num_kv_heads * d
                           + 3 * h * c.intermediate_size) + c.vocab_size * h


def flops(name, tokens, context, batch, last_only=False):
    c = configs.get(name)
    head = c.vocab_size * c.hidden_size
    keys = sum(context + i for i in range(1, tokens + 1))
    attn = batch * c.num_layers * c.num_heads * 4 * c.head_dim * keys
    return (2 * (matmul_params(name) - head) * batch * tokens
            + 2 * head * (batch if last_only else batch * tokens) + attn)


def step_bytes(name, batch, tokens, context):
    return read_params(name) * 2 + batch * (context + tokens) * kv_token(name)


def gpu(name):
    return kvmath.GPUS[name]


def expected(gen, p):
    """The answer of generator `gen` recomputed from its drawn parameters p."""
    if gen in ("kv_per_token",):
        return kv_token(p["model"], p["dtype"])
    if gen in ("kv_per_sequence", "long_context_kv"):
        return kv_token(p["model"], p["dtype"]) * p["seq_len"]
    if gen in ("max_concurrency", "kv_pool_tokens"):
        g = gpu(p["gpu"])
        usable = int(g.memory_bytes * p["util"]) * p["num_gpus"]
        pool = max(0, usable - int(params(p["model"]) * BYTES[p["weight_dtype"]]))
        tokens = pool // kv_token(p["model"], p["kv_dtype"])
        return tokens // p["context"] if gen == "max_concurrency" else tokens
    if gen == "weight_memory":
        assert p["params"] == params(p["model"])
        return p["params"] * BYTES[p["dtype"]]
    if gen == "tp_weights_per_gpu":
        return int(params(p["model"]) * BYTES[p["dtype"]]) / p["tp"]
    if gen == "block_bytes":
        return p["block_size"] * kv_token(p["model"], p["dtype"])
    if gen == "block_table_overhead":
        return 4 / (p["block_size"] * kv_token(p["model"]))
    if gen == "gqa_saving":
        c = configs.get(p["model"])
        mha = c.num_layers * c.num_heads * (c.head_dim + (c.v_head_dim or c.head_dim)) * 2
        return mha / kv_token(p["model"])
    if gen == "mlp_activation":
        return p["tokens"] * 2 * configs.get(p["model"]).intermediate_size * 2
    if gen == "ridge":
        return gpu(p["gpu"]).bf16_flops / gpu(p["gpu"]).bandwidth
    if gen == "decode_step_time":
        return step_bytes(p["model"], p["batch"], 1, p["context"]) / gpu(p["gpu"]).bandwidth
    if gen == "decode_tokens_per_s":
        return gpu(p["gpu"]).bandwidth / (read_params(p["model"]) * BYTES[p["dtype"]])
    if gen == "decode_intensity":
        return (flops(p["model"], 1, p["context"], p["batch"])
                / step_bytes(p["model"], p["batch"], 1, p["context"]))
    if gen == "prefill_time":
        g = gpu(p["gpu"])
        return max(flops(p["model"], p["tokens"], 0, 1, last_only=True) / g.bf16_flops,
                   step_bytes(p["model"], 1, p["tokens"], 0) / g.bandwidth)
    if gen == "compute_cap_tokens":
        return gpu(p["gpu"]).bf16_flops / (2 * matmul_params(p["model"]))
    if gen == "bandwidth_ratio":
        return gpu(p["a"]).bandwidth / gpu(p["b"]).bandwidth
    if gen == "blocks_for_mix":
        return sum(math.ceil(n / p["block_size"]) for n in p["lengths"])
    if gen == "paged_waste":
        alloc = sum(math.ceil(n / p["block_size"]) * p["block_size"] for n in p["lengths"])
        return (alloc - sum(p["lengths"])) / alloc
    if gen == "contiguous_waste":
        return 1 - sum(p["lengths"]) / (p["max_len"] * len(p["lengths"]))
    if gen == "fork_sharing":
        return blocks_saved_by_block_manager(p["prompt"], p["n"], p["block_size"], p["when"])
    if gen == "prefix_savings":
        return (p["prefix"] // p["block_size"]) * p["block_size"] * (p["n"] - 1)
    if gen == "chunked_prefill_steps":
        return math.ceil(p["prompt"] / (p["budget"] - p["decodes"]))
    if gen == "spec_speedup":
        a, k, c = p["alpha"], p["k"], p["c"]
        return sum(a**i for i in range(k + 1)) / (k * c + 1)
    if gen == "spec_tokens_per_step":
        return sum(p["alpha"]**i for i in range(p["k"] + 1))
    if gen == "spec_break_even":
        k, c = p["k"], p["c"]                        # scan instead of bisection
        return next(a / 10000 for a in range(10000)
                    if sum((a / 10000)**i for i in range(k + 1)) >= k * c + 1)
    if gen == "littles_concurrency":
        return p["rate"] * p["latency"]
    if gen == "littles_latency":
        return p["slots"] / p["rate"]
    if gen == "e2e_latency":
        return p["ttft"] + (p["n"] - 1) * p["tpot"]
    if gen == "cost_per_mtok":
        return p["price"] * p["num_gpus"] * 1e6 / (p["tps"] * 3600)
    if gen == "swap_time":
        return 2 * kv_token(p["model"]) * p["seq_len"] / (p["bw_gb"] * 1e9)
    if gen == "kv_transfer_disagg":
        return kv_token(p["model"]) * p["seq_len"] / (p["gbit"] * 1e9 / 8)
    if gen == "lora_size":
        c = configs.get(p["model"])
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sizes = {"q": h + q, "k": h + kv, "v": h + kv, "o": q + h}       # in + out per module
        return c.num_layers * sum(p["rank"] * sizes[m] for m in p["modules"]) * 2
    if gen == "recompute_ratio":
        n = p["n"]
        return (n * (n + 1) / 2) / n
    raise AssertionError(f"no recomputation for generator {gen}")


def blocks_saved_by_block_manager(prompt, n, bs, when):
    """Fork n samples from one prompt on minillm's real BlockManager and count used blocks."""
    def used(share):
        m = BlockManager(4096, bs)
        if share:
            m.allocate("s0", prompt)
            for i in range(1, n):
                m.fork("s0", f"s{i}")
        else:
            for i in range(n):
                m.allocate(f"s{i}", prompt)
        if when == "after_first_write":
            for i in range(n):
                m.allocate(f"s{i}", prompt + 1)
        return 4096 - m.num_free_blocks
    return used(False) - used(True)


NUMERIC = drill.load_bank(kind="numeric")


def test_every_generator_is_used_and_recomputed():
    used = {q.generator for q in NUMERIC}
    assert used == set(generators.GENERATORS)


@pytest.mark.parametrize("q", NUMERIC, ids=lambda q: q.id)
def test_generator_answer_equals_independent_recomputation(q):
    for seed in SEEDS:
        inst = q.instance(seed)
        want = expected(q.generator, inst.params)
        # the scan above steps by 1e-4; everything else must agree to rounding
        tol = (dict(rel=0, abs=1.5e-4) if q.generator == "spec_break_even"
               else dict(rel=1e-9, abs=1e-12))
        assert inst.value == pytest.approx(want, **tol), (q.id, seed, inst.params)


def test_expected_tokens_per_step_matches_simulation():
    """The drill's speculative answers come from minillm.spec.theory: check it against a
    simulation."""
    rng = random.Random(0)
    for alpha, k in ((0.5, 4), (0.8, 3), (0.3, 6)):
        trials, total = 20000, 0
        for _ in range(trials):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            total += accepted + 1                      # the target's own or bonus token
        assert total / trials == pytest.approx(theory.expected_tokens(alpha, k), rel=0.02)


def test_break_even_is_where_speedup_is_one():
    for k, c in ((4, 0.05), (4, 0.2), (4, 0.5), (8, 0.1)):
        a = theory.break_even_alpha(k, c)
        assert theory.speedup(a, k, c) == pytest.approx(1.0, abs=1e-9)
        assert theory.speedup(min(0.999, a + 0.05), k, c) > 1
        assert theory.speedup(max(0.0, a - 0.05), k, c) < 1
    # the numbers a common claim gets wrong: break-even is not a fixed 50 %
    assert theory.break_even_alpha(4, 0.05) == pytest.approx(0.17, abs=0.01)
    assert theory.break_even_alpha(4, 0.5) == pytest.approx(0.74, abs=0.01)
    assert theory.speedup(0.5, 4, 0.05) == pytest.approx(1.61, abs=0.01)
    # a draft dearer than the target never pays, even when every draft is accepted:
    # (k + 1) / (k c + 1) < 1, so there is no break-even (nan), not one "close to 1"
    assert theory.speedup(1.0, 4, 1.5) < 1 and math.isnan(theory.break_even_alpha(4, 1.5))


def test_acceptance_rate_is_one_minus_total_variation():
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    tv = 0.5 * float((p - q).abs().sum())
    assert theory.acceptance_prob(p, q) == pytest.approx(1 - tv)
    assert theory.total_variation(p, q) == pytest.approx(tv)


def test_formula_inputs_are_checked():
    with pytest.raises(ValueError, match="alpha"):
        theory.speedup(1.5, 4, 0.1)
    with pytest.raises(ValueError, match="k >= 0"):
        theory.expected_tokens(0.5, -1)
    with pytest.raises(ValueError, match="c must be >= 0"):
        theory.break_even_alpha(4, -0.1)
    with pytest.raises(ValueError, match="arrival rate"):
        capacity.littles_law_latency(10, 0)
    with pytest.raises(ValueError, match="num_gpus"):
        capacity.cost_per_million_tokens(2.0, 1000, num_gpus=0)
    with pytest.raises(ValueError, match="unknown numeric generator"):
        generators.make_numeric("nope", 0, {})


def test_prefix_savings_match_minillm_prefix_cache():
    """The drill's prefix arithmetic against the engine's own prefix-caching block manager: the
    first request computes and caches its prompt; a second one with the same P-token prefix
    (then different tokens) hits exactly floor(P / block_size) blocks."""
    from minillm.cache.prefix import PrefixCachingBlockManager, num_cacheable_blocks
    rng = random.Random(1)
    for _ in range(30):
        bs = rng.choice([4, 8, 16])
        prefix = rng.randint(1, 90)
        first = list(range(1000, 1000 + prefix)) + [1, 2, 3] * 5
        second = list(range(1000, 1000 + prefix)) + [7, 8, 9] * 7
        bm = PrefixCachingBlockManager(256, bs)
        bm.allocate("a", len(first))
        bm.cache_full_blocks("a", len(first), lambda s, e: first[s:e])
        hits = bm.find_cached_blocks(second)
        assert len(hits) * bs == formulas.prefix_cached_tokens(prefix, bs)
    # a prompt seen whole: the last token is computed, so the hit stops a block short
    assert num_cacheable_blocks(64, 16) == 3 == (64 - 1) // 16


@pytest.mark.parametrize("gen", ["decode_step_time", "decode_tokens_per_s", "decode_intensity",
                                 "compute_cap_tokens"])
def test_single_gpu_questions_never_pose_weights_that_do_not_fit(gen):
    for seed in range(60):
        n = generators.make_numeric(gen, f"fit:{seed}", {})
        p = n.params
        gpu = kvmath.GPUS[p.get("gpu", "H100-SXM-80GB")]
        weights = kvmath.weight_bytes(configs.get(p["model"]), p.get("dtype", "bfloat16"))
        assert weights <= 0.9 * gpu.memory_bytes, (gen, p)
