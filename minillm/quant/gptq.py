"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): int4 that corrects its own rounding error.

Round-to-nearest rounds every weight on its own. GPTQ quantizes the columns of W [N, K] one at a
time and, after rounding column j, spreads that column's error over the columns not yet
quantized, in the direction that least changes the layer's OUTPUT on real inputs. The inputs
enter only through the Hessian of the layer's squared output error,

    H = 2 X^T X / n          X [n, K]: the layer's inputs on a small calibration set

Using the upper Cholesky factor U of H^-1 (so each step is one row of U), for column j:

    q_j   = quantize(w_j)                         (group-wise int4, scale/zero of its group)
    err_j = (w_j - q_j) / U[j, j]
    W[:, j+1:] -= err_j  U[j, j+1:]               (the not-yet-quantized columns absorb it)

Layer by layer: the calibration activations run through decoder block i, its linears are
quantized with their Hessians, and the QUANTIZED block's outputs feed block i + 1, so later
blocks compensate the errors earlier ones already made. Output: Int4Linear modules holding the
same format as round-to-nearest (same bits, same kernel); only the chosen integers differ.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .linear import Int4Linear
from .rtn import check_group_size, int4_params


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, group_size: int = 64,
                  damp: float = 0.01, block: int = 128):
    """W [N, K], H [K, K] -> (q uint8 [N, K], scale [N, K/g], zero [N, K/g]) as quantize_int4."""
    W = w.detach().float().clone()
    N, K = W.shape
    check_group_size(group_size, K)
    if block % group_size:
        raise ValueError(f"block {block} must be a multiple of group_size {group_size}")
    H = H.float().clone()
    dead = torch.diag(H) == 0                          # inputs that never fire: weight unused
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(K)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros(N, K)
    scale = torch.zeros(N, K // group_size)
    zero = torch.zeros(N, K // group_size)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        W1, E1 = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0)
        for i in range(b1 - b0):
            j = b0 + i
            if j % group_size == 0:                    # a new group: its range as it is NOW
                s, z = int4_params(W1[:, i:i + group_size][:, None])          # [N, 1] each
                scale[:, j // group_size], zero[:, j // group_size] = s[:, 0], z[:, 0]
            g = j // group_size
            col = W1[:, i]
            q = torch.clamp(torch.round(col / scale[:, g]) + zero[:, g], 0, 15)
            Q[:, j] = q
            err = (col - (q - zero[:, g]) * scale[:, g]) / U[j, j]
            W1[:, i:] -= err[:, None] * U[j, j:b1][None, :]
            E1[:, i] = err
        W[:, b1:] -= E1 @ U[b0:b1, b1:]
    return Q.to(torch.uint8), scale, zero


class HessianHook:
    """Accumulates H = 2 X^T X / n over every call of one linear layer."""

    def __init__(self, linear: nn.Linear):
        self.H = torch.zeros(linear.in_features, linear.in_features)
        self.n = 0
        self.handle = linear.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()   # [rows, K]
        rows = x.shape[0]
        self.H *= self.n / (self.n + rows)
        self.n += rows
        x = x * (2 / self.n) ** 0.5
        self.H += x.t() @ x


@torch.no_grad()
def input_groups(layer, x, cos, sin) -> list:
    """The block's linears as [[(parent, name, linear)]], grouped by the input they share, in
    the order the forward reaches them (one probe forward)."""
    where = {id(m): (p, n, m) for p in layer.modules() for n, m in p.named_children()
             if isinstance(m, nn.Linear)}
    seen: dict = {}                                    # input tensor id -> [linear ids]
    alive = []                                         # keeps inputs alive: ids stay unique

    def probe(mod, inp, out):
        alive.append(inp[0])
        seen.setdefault(id(inp[0]), []).append(id(mod))

    probes = [where[k][2].register_forward_hook(probe) for k in where]
    layer(x, cos, sin)
    for h in probes:
        h.remove()
    return [[where[k] for k in ids] for ids in seen.values()]


@torch.no_grad()
def gptq_quantize_model(model, calibration_ids: torch.Tensor, group_size: int = 64,
                        damp: float = 0.01):
    """Quantize the decoder's linears to int4 with GPTQ, block by block, in place.

    calibration_ids [S, T]: a few token sequences (e.g. 8 x 128 tokens of text). Returns the
    model (with Int4Linear layers, like quantize_model(model, "int4"))."""
    if calibration_ids.dim() != 2 or calibration_ids.numel() == 0:
        raise ValueError("calibration_ids must be a non-empty [num_sequences, num_tokens] tensor")
    for layer in model.layers:                         # every layer must fit before any changes
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                check_group_size(group_size, m.in_features)
    ids = calibration_ids.to(model.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    cos, sin = model.rope(positions)
    x = model.embed_tokens(ids)                        # [S, T, C]: the first block's inputs
    for layer in model.layers:
        # Inside one block each linear's inputs depend on the linears before it: quantize the
        # groups that share one input (q/k/v, then o, gate/up, down) in order of execution,
        # re-running the block each time so later groups see the earlier ones quantized.
        for group in input_groups(layer, x, cos, sin):
            hooks = [HessianHook(lin) for _, _, lin in group]
            layer(x, cos, sin)
            for (parent, name, lin), h in zip(group, hooks):
                h.handle.remove()
                q, s, z = gptq_quantize(lin.weight, h.H, group_size, damp)
                setattr(parent, name, Int4Linear(lin, group_size, q, s, z))
        x = layer(x, cos, sin)                         # the quantized block feeds the next
    model.quantization = "int4"
    return model
