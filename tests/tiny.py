"""The tiny random-weight model (SmolLM2's vocabulary and tokenizer, 2 layers of width 64) that
engine, server and router tests run on: seconds to build, real tokenizer, no download."""
import torch

from minillm import configs
from minillm.loader import random_model


def tiny_model(max_position_embeddings: int = 256):
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=max_position_embeddings)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)
