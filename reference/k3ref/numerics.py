"""Numeric primitives of the K3.1 reference (MODEL.md §3 "Conventions", §0.10).

All activations are held in the *compute dtype* (float64 by default, float32 optional).  A value that the spec
says is "rounded to BF16" is rounded with `bf16()` and kept in the compute dtype, so it is exactly
representable in BF16 from then on.  `bf16()` rounds a float64 value *directly* to the nearest BF16 value
(ties to even); torch's own float64 -> bfloat16 cast goes through float32 and can double-round.

`rounding(False)` turns every BF16 rounding into the identity: the tests use it to show that two algebraically
equal forms (recurrent/chunked KDA, naive/absorbed MLA) agree to FP64 precision when no rounding intervenes.
"""
from __future__ import annotations

import contextlib
import math

import torch

_STATE = {"round": True}


@contextlib.contextmanager
def rounding(enabled: bool):
    """Enable/disable all BF16 roundings inside the block (tests only)."""
    old = _STATE["round"]
    _STATE["round"] = enabled
    try:
        yield
    finally:
        _STATE["round"] = old


def rounding_enabled() -> bool:
    return _STATE["round"]


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest BF16 value (ties to even), result in x's dtype.

    float64 input: a single correct rounding (no double rounding through float32)."""
    if not _STATE["round"]:
        return x
    if x.dtype == torch.float32:
        return x.to(torch.bfloat16).to(torch.float32)
    if x.dtype != torch.float64:
        raise TypeError(f"bf16() expects float32/float64, got {x.dtype}")
    f = x.to(torch.float32)  # RNE to float32
    bits = f.view(torch.int32)
    # A float32 value sitting exactly on a BF16 midpoint that is not the exact float64 value would be
    # double-rounded: nudge it one float32 ulp towards the true value so the next rounding is correct.
    mid = ((bits & 0xFFFF) == 0x8000) & (f.to(torch.float64) != x) & torch.isfinite(x)
    if bool(mid.any()):
        toward = torch.where(x > f.to(torch.float64), torch.full_like(f, math.inf), torch.full_like(f, -math.inf))
        f = torch.where(mid, torch.nextafter(f, toward), f)
    return f.to(torch.bfloat16).to(x.dtype)


def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """§3 `Lin(W)(x) = x Wᵀ`: BF16 inputs/weights, wide accumulation, output rounded to BF16."""
    return bf16(x @ w.transpose(-1, -2))


def lin_nr(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x Wᵀ without output rounding (FP32/FP64 paths: router §3.6.1, indexer weights_proj §3.5.3)."""
    return x @ w.transpose(-1, -2)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§3 `RMSNorm_w,ε(x) = w ⊙ bf16(x · rsqrt(mean(x²) + ε))`, HF order; the product with a BF16 weight is a
    BF16 x BF16 multiply, so it is rounded to BF16 as well (one more rounding; exact if w == 1)."""
    n = bf16(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return bf16(w * n)


def rmsnorm_nr(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm entirely in the compute dtype, no rounding (KDA o_norm, §3.3.7)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm (indexer k_norm, §0.1/§3.5.2): computed wide, output rounded to BF16 once."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) * torch.rsqrt(var + eps) * w
    if b is not None:
        y = y + b
    return bf16(y)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (§3.6.3): `β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)` in the compute dtype, cast BF16."""
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return bf16(a)


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k along the last dim, exact ties broken toward the lower index (§0.8).

    Returned indices are in selection order (descending score; among equal scores ascending index)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
