"""MXFP4 expert storage (MODEL.md §4) and the writing rule of §0.9 (used by the test fixture only)."""
from __future__ import annotations

import torch

# E2M1 code -> value (§4); bit 3 is the sign.
E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def dequant(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """`W[r,c] = LUT[(P[r,c>>1] >> 4(c&1)) & 0xF] · 2^(S[r,c>>5] − 127)` (§4). packed U8 [out, in/2],
    scale U8 (E8M0) [out, in/32] -> W [out, in] (exact)."""
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    out, half = packed.shape
    n_in = half * 2
    assert scale.shape == (out, n_in // 32), (packed.shape, scale.shape)
    if bool((scale == 255).any()):
        raise ValueError("E8M0 scale 255 (NaN) in an MXFP4 weight")
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).reshape(out, n_in)  # low nibble = even element
    vals = E2M1_LUT[codes]
    exps = scale.to(torch.int64).repeat_interleave(32, dim=1) - 127
    return torch.ldexp(vals, exps.to(torch.float64)).to(dtype)


# positive E2M1 magnitudes and their codes
_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§0.9: per 32-block the smallest power-of-two scale with max|x|/scale ≤ 6; round each element to the
    nearest E2M1 value (ties to the even code), saturate at ±6.  Returns (packed U8, scale U8)."""
    w = w.to(torch.float64)
    out, n_in = w.shape
    assert n_in % 32 == 0
    blocks = w.reshape(out, n_in // 32, 32)
    amax = blocks.abs().amax(-1)
    # smallest e with amax / 2^e <= 6 ; all-zero block -> smallest normal-ish exponent that keeps code 0
    e = torch.ceil(torch.log2(torch.clamp(amax, min=2.0 ** -126) / 6.0))
    # guard against log2 rounding: make sure amax/2^e <= 6 and amax/2^(e-1) > 6
    e = torch.where(amax / torch.ldexp(torch.ones_like(e), e) > 6.0, e + 1, e)
    e = torch.clamp(e, -127, 127)
    x = blocks / torch.ldexp(torch.ones_like(e), e).unsqueeze(-1)
    mag = x.abs().clamp(max=6.0)
    d = (mag.unsqueeze(-1) - _MAGS).abs()  # [..., 8]
    best = d.min(-1, keepdim=True).values
    cand = d == best
    # ties: prefer the even code (codes 0..7 index the magnitudes; a tie is between two adjacent codes)
    idx = torch.arange(8)
    code_mag = torch.argmin(torch.where(cand, idx % 2, 2), dim=-1)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    code = code_mag + 8 * sign.to(torch.int64)
    code = torch.where(code_mag == 0, torch.zeros_like(code), code)  # store +0 for zeros
    code = code.reshape(out, n_in)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    scale = (e + 127).to(torch.uint8)
    return packed, scale
