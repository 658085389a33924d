"""The bundled GGUF's Q4_1 blocks, decoded by hand (chapter 09).

llama.cpp's Q4_1 stores a tensor in blocks of 32 consecutive weights of a row, 20 bytes each:

    bytes 0-1    d   float16   the step (scale)
    bytes 2-3    m   float16   the block's minimum
    bytes 4-19   qs  16 bytes  32 4-bit codes: value i (i < 16) in the LOW nibble of byte i,
                               value i + 16 in the HIGH nibble of byte i
    weight = d * code + m

5 bits per weight (4 for the code, 32 bits of d and m shared by 32 weights). Asymmetric like
our int4, but with a float minimum instead of an integer zero point, so zero itself is usually
not on the grid. The SmolLM2 file ships its decoder layers in Q4_1 and its embedding (= the
tied LM head) in Q8_0 (blocks of 32 int8 codes with one float16 scale: weight = d * code).
`read_gguf_tensor` returns the raw blocks; `decode_q4_1` turns them into float32.
"""
from __future__ import annotations

import numpy as np
import torch

Q4_1_BLOCK = 32                 # weights per block
Q4_1_BYTES = 20                 # 2 (d) + 2 (m) + 16 (32 nibbles)


def decode_q4_1(raw: np.ndarray, shape) -> torch.Tensor:
    """raw uint8 bytes of a Q4_1 tensor -> float32 tensor of `shape` ([rows, cols])."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, Q4_1_BYTES)     # [num_blocks, 20]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)        # [num_blocks, 1]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]                                                   # [num_blocks, 16]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)                 # [num_blocks, 32]
    return torch.from_numpy(d * codes + m).reshape(shape)


def read_gguf_tensor(path, name: str):
    """(raw uint8 bytes, shape [rows, cols], type name) of one tensor of a GGUF file."""
    import gguf

    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == name:
            rows_cols = tuple(int(n) for n in reversed(t.shape))         # GGUF lists cols first
            return np.asarray(t.data), rows_cols, t.tensor_type.name
    raise ValueError(f"{path} has no tensor {name!r}")
