"""MXFP4 quantisation-aware training (MODEL.md §0.9 writing rule, §4 format) with a straight-through estimator.

`fake_quant(w)` returns dequant(quantize(w)) exactly as `k3ref.mxfp4` defines them (checked bit-exact in
tests/py/test_k3train.py), computed with vector ops on the GPU: per 32-block along the input (last) dim the
smallest power-of-two scale with max|x|/scale ≤ 6, then round-to-nearest E2M1 with ties to the even code.
The rounding is done by counting thresholds: between adjacent magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6] the
midpoints are [.25, .75, 1.25, 1.75, 2.5, 3.5, 5]; at a tie the even code wins, i.e. ties go down at
.25, 1.25, 2.5, 5 (`>`) and up at .75, 1.75, 3.5 (`>=`).
`ste(w)` = w + (fake_quant(w) − w).detach(): the forward uses the MXFP4 weight, the gradient flows to w.
"""
from __future__ import annotations

import torch

_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_DOWN = (0.25, 1.25, 2.5, 5.0)   # tie -> lower (even) code
_UP = (0.75, 1.75, 3.5)          # tie -> upper (even) code


def block_exponent(w: torch.Tensor) -> torch.Tensor:
    """[..., n/32] integer exponents e with amax/2^e ≤ 6 < amax/2^(e−1) (clamped to [−127, 127])."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1).to(torch.float64)
    e = torch.ceil(torch.log2(torch.clamp(amax, min=2.0 ** -126) / 6.0))
    one = torch.ones_like(e)
    e = torch.where(amax / torch.ldexp(one, e) > 6.0, e + 1, e)
    e = torch.where((amax / torch.ldexp(one, e - 1) <= 6.0) & (amax > 2.0 ** -126), e - 1, e)
    return torch.clamp(e, -127, 127)


@torch.no_grad()
def fake_quant(w: torch.Tensor) -> torch.Tensor:
    shape = w.shape
    assert shape[-1] % 32 == 0, "MXFP4 blocks run along the input dim, which must be a multiple of 32"
    x64 = w.to(torch.float64).reshape(*shape[:-1], shape[-1] // 32, 32)
    e = block_exponent(w)
    scale = torch.ldexp(torch.ones_like(e), e).unsqueeze(-1)
    x = x64 / scale
    mag = x.abs().clamp(max=6.0)
    code = torch.zeros_like(mag, dtype=torch.int64)
    for t in _DOWN:
        code += (mag > t).to(torch.int64)
    for t in _UP:
        code += (mag >= t).to(torch.int64)
    lut = torch.tensor(_MAGS, dtype=torch.float64, device=w.device)
    q = lut[code] * torch.sign(x) * scale
    return q.reshape(shape).to(w.dtype)


def ste(w: torch.Tensor) -> torch.Tensor:
    return w + (fake_quant(w) - w).detach()
