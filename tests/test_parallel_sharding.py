"""Tensor-parallel sharding (chapter 10) without worker processes: each rank is a thread with
its own gloo group, so the math is checked in a second or two.

A sharded forward must give the full model's logits within fp32 tolerance (tp = 2: KV heads
split; tp = 4 on 2 KV heads: KV heads replicated), and the all-reduces counted by the
Communicator must be exactly two per layer of [tokens, hidden] fp32 values.
"""
import pytest
import torch
from test_engine_modes import tiny_model

from minillm import configs
from minillm.lab.parallel_lab import threaded_tp_forward
from minillm.parallel import (check_tp_size, kv_head_range, ring_all_reduce_bytes, shard_config,
                              shard_state_dict, tp_sizes)
from minillm.parallel.worker import build_shard

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bundled_model_splits_over_1_and_3_ranks_only():
    cfg = configs.get("smollm2-135m")                 # 9 query heads, 3 KV heads, 1536 neurons
    assert tp_sizes(cfg, 16) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*sizes that work: \[1, 3\]"):
        check_tp_size(cfg, 2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            check_tp_size(cfg, bad)
    local = shard_config(cfg, 3)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert local.head_dim == cfg.head_dim and local.hidden_size == cfg.hidden_size


def test_kv_heads_replicate_when_ranks_outnumber_them():
    cfg = tiny_model().config                           # 4 query heads, 2 KV heads
    assert [list(kv_head_range(cfg, r, 2)) for r in range(2)] == [[0], [1]]
    # tp = 4: query heads 0,1 use KV head 0 and 2,3 use KV head 1, one query head per rank
    assert [list(kv_head_range(cfg, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert shard_config(cfg, 4).num_kv_heads == 1


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_forward_equals_the_full_model_and_counts_two_all_reduces_per_layer(tp):
    model = tiny_model()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=g)
    with torch.inference_mode():
        ref = model(input_ids)                                             # [1, 11, V]
    logits, stats = threaded_tp_forward(model, tp, input_ids)
    for rank in range(tp):
        torch.testing.assert_close(logits[rank], ref, rtol=1e-5, atol=1e-4)   # logits ~10, fp32
    tokens = input_ids.numel()
    for s in stats:
        assert s.all_reduce_calls == 2 * cfg.num_layers
        assert s.all_reduce_bytes == 2 * cfg.num_layers * tokens * cfg.hidden_size * 4
        assert s.wire_bytes(tp) == ring_all_reduce_bytes(s.all_reduce_bytes, tp)
    assert ring_all_reduce_bytes(100, 2) == 100 and ring_all_reduce_bytes(100, 4) == 150


def test_a_shard_without_its_all_reduces_is_wrong():
    """The check above can fail: rank 0's partial sums alone are not the model's output."""
    model = tiny_model()
    cfg = model.config
    shard = build_shard(shard_config(cfg, 2), shard_state_dict(model.state_dict(), cfg, 0, 2),
                        torch.float32)
    input_ids = torch.arange(7)[None]
    with torch.inference_mode():
        assert not torch.allclose(shard(input_ids), model(input_ids), atol=1e-3)
