"""The disk KV tier under the prefix cache (chapter 11): evicted blocks are saved, a later prompt
reloads them instead of recomputing, greedy outputs never change, a damaged or mismatched file
is never served, the tier stays under its size, and bad configuration names the fix."""
import random
import types

import pytest
import torch

from minillm import SamplingParams, configs
from minillm.cache.tier import DiskKVTier
from minillm.engine import LLM
from minillm.loader import random_model

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 16


@pytest.fixture(scope="module")
def model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=512)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)


def prompts(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(length)] for _ in range(n)]


def llm(model, tmp_path=None, max_bytes=2 ** 30, **kw):
    kw = {"num_kv_blocks": 12, "block_size": BS, "max_num_seqs": 4, **kw}
    tier = None if tmp_path is None else {"kv_connector": "disk", "path": str(tmp_path),
                                          "max_bytes": max_bytes}
    return LLM((model, None), kv_transfer_config=tier, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run(engine, ps):
    return engine.generate(ps, GREEDY, use_tqdm=False)


def test_an_evicted_prefix_comes_back_from_disk_and_the_output_is_unchanged(model, tmp_path):
    a = prompts(1, 5 * BS + 3, seed=1)                    # 5 full blocks + 3 tokens
    others = prompts(4, 5 * BS, seed=2)                   # enough to evict all of a's blocks
    ref = run(llm(model), a)[0]
    eng = llm(model, tmp_path)
    first = run(eng, a)[0]
    run(eng, others)
    tier = eng.engine.kv_connector
    assert tier.stats.saves >= 5 and len(list(tmp_path.glob("*.safetensors"))) == tier.stats.saves
    again = run(eng, a)[0]
    assert first.token_ids == again.token_ids == ref.token_ids
    assert again.num_cached_tokens == 5 * BS             # every full block, from disk
    assert tier.stats.loads == 5 and tier.stats.corrupt == 0


def test_a_damaged_file_is_refused_and_recomputed(model, tmp_path):
    a = prompts(1, 5 * BS + 3, seed=1)
    eng = llm(model, tmp_path)
    want = run(eng, a)[0].token_ids
    run(eng, prompts(4, 5 * BS, seed=2))
    files = sorted(tmp_path.glob("*.safetensors"))
    for f in files:                                        # one flipped byte near the end: data
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    again = run(eng, a)[0]
    assert again.token_ids == want
    assert again.num_cached_tokens == 0
    assert eng.engine.kv_connector.stats.corrupt >= 1 and eng.engine.kv_connector.stats.loads == 0


def test_a_file_under_the_wrong_key_is_never_served(model, tmp_path):
    t = DiskKVTier(tmp_path, 2 ** 30, BS)
    k, v = torch.zeros(2, BS, 2, 16), torch.ones(2, BS, 2, 16)
    toks = list(range(BS))
    from minillm.cache.prefix import hash_block_tokens
    key = hash_block_tokens(None, toks)
    t.save(key, toks, None, None, k, v)
    req = types.SimpleNamespace(cache_salt=None)
    assert len(t.lookup(req, toks + [1], 0)[1]) == 1
    other = [5] + toks[1:]                                 # a different block: another key
    (tmp_path / f"{key:016x}.safetensors").rename(
        tmp_path / f"{hash_block_tokens(None, other):016x}.safetensors")
    t2 = DiskKVTier(tmp_path, 2 ** 30, BS)                 # re-indexes the directory
    assert t2.lookup(req, other + [1], 0) == (0, []) and t2.stats.corrupt == 1


def test_the_tier_stays_under_max_bytes_dropping_the_least_recent(model, tmp_path):
    eng = llm(model, tmp_path, max_bytes=6 * 9000)
    run(eng, prompts(6, 5 * BS, seed=3))
    tier = eng.engine.kv_connector
    assert tier.stats.saves > 6 and tier.stats.evicted > 0
    assert tier.num_bytes <= tier.max_bytes
    assert sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) == tier.num_bytes


def test_greedy_outputs_equal_under_chunked_prefill_preemption_and_repeats(model, tmp_path):
    ps = prompts(6, 3 * BS + 5, seed=4)
    ps = ps + [p[:2 * BS] + q[2 * BS:] for p, q in zip(ps, prompts(6, 3 * BS + 5, seed=5))]
    kw = {"num_kv_blocks": 10, "max_num_batched_tokens": 24, "max_num_seqs": 3}
    ref = [o.token_ids for o in run(llm(model, **kw), ps)]
    eng = llm(model, tmp_path, **kw)
    for _ in range(2):                                     # the second round reloads from disk
        assert [o.token_ids for o in run(eng, ps)] == ref
    assert eng.engine.kv_connector.stats.loads > 0
    assert eng.engine.scheduler.num_preemptions > 0


def test_reset_prefix_cache_empties_the_tier(model, tmp_path):
    eng = llm(model, tmp_path)
    run(eng, prompts(4, 5 * BS, seed=6))
    assert list(tmp_path.glob("*.safetensors"))
    eng.engine.reset_prefix_cache()
    assert not list(tmp_path.glob("*.safetensors"))


def test_bad_tier_configuration_names_the_fix(model, tmp_path):
    with pytest.raises(ValueError, match="kv_connector 'disk'"):
        llm(model, num_kv_blocks=8).__class__((model, None), kv_transfer_config={"x": 1})
    with pytest.raises(ValueError, match="needs 'path'"):
        LLM((model, None), num_kv_blocks=8, kv_transfer_config={"kv_connector": "disk"})
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        LLM((model, None), num_kv_blocks=8, enable_prefix_caching=False,
            kv_transfer_config={"kv_connector": "disk", "path": str(tmp_path)})
    with pytest.raises(ValueError, match="max_bytes"):
        LLM((model, None), num_kv_blocks=8,
            kv_transfer_config={"kv_connector": "disk", "path": str(tmp_path), "max_bytes": 0})
