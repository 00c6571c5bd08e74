"""MXFP4 (OCP MX, E2M1 elements + E8M0 block scales) quantiser in vectorised numpy.

Storage layout = compressed-tensors `mxfp4-pack-quantized` as used by the K3 experts (MODEL.md §4):
`packed` u8 [..., K/2] with element 2j in the LOW nibble and 2j+1 in the HIGH nibble; `scale` u8 [..., K/32]
holding the E8M0 exponent e (value 2^(e-127)); blocks of 32 run along the last axis.
Rounding rule = MODEL.md §0.9: per block the smallest power-of-two scale with max|x|/scale <= 6, then
round-to-nearest E2M1 with ties to the even code, saturating at ±6.

Tricks, all so that the result is bit-exact and platform independent:
- The exponent comes from `frexp` of the block max and an exact mantissa comparison, never from log2 of a
  division (amax/6 is inexact and log2 is a libm call).
- x / 2^e is done with `ldexp` in float64, which is exact for every float32 input and every e in [-127, 127].
- E2M1 rounding is a sum of seven threshold comparisons; at each midpoint the comparison is strict or not
  depending on which neighbour has the even code, which is exactly round-half-to-even on the code.
- An all-zero (or all-tiny) block gets the smallest representable scale, e = 0 (2^-127); §0.9 asks for
  the smallest scale and any scale represents zeros exactly. Blocks beyond 6·2^127 clamp to e = 254.
- The sign is kept even when the magnitude rounds to 0 (code 8 = -0), like an IEEE narrowing conversion.
"""
import numpy as np

BLOCK = 32
E2M1_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# (midpoint between code i and i+1, True when the upper code i+1 is even so a tie rounds up)
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_code(a):
    """|value| (float64 array, already divided by the block scale) -> E2M1 magnitude code 0..7."""
    code = np.zeros(a.shape, dtype=np.uint8)
    for mid, tie_up in _MIDPOINTS:
        code += (a >= mid) if tie_up else (a > mid)
    return code


def block_exponent(amax):
    """Smallest integer e in [-127, 127] with amax <= 6·2^e (exact, via frexp)."""
    m, p = np.frexp(amax)                      # amax = m·2^p, m in [0.5, 1)
    e = np.where(m <= 0.75, p - 3, p - 2)      # 6·2^(p-3) = 0.75·2^p ; 6·2^(p-2) = 1.5·2^p > amax
    e = np.where(amax == 0, -127, e)
    return np.clip(e, -127, 127).astype(np.int32)


def quantize_mxfp4(x):
    """float array [..., K] (K % 32 == 0) -> (packed u8 [..., K/2], scale u8 [..., K/32])."""
    x = np.asarray(x)
    if x.shape[-1] % BLOCK:
        raise ValueError("last dimension %d is not a multiple of %d" % (x.shape[-1], BLOCK))
    xb = x.astype(np.float64).reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))
    if not np.isfinite(xb).all():
        raise ValueError("MXFP4 quantisation of non-finite values")
    e = block_exponent(np.abs(xb).max(axis=-1))
    y = np.ldexp(xb, -e[..., None])
    code = e2m1_code(np.abs(y)) | (np.signbit(y).astype(np.uint8) << 3)
    code = code.reshape(x.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (e + 127).astype(np.uint8)


def unpack_codes(packed):
    """u8 [..., K/2] -> nibble codes u8 [..., K] (low nibble first)."""
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def dequantize_mxfp4(packed, scale):
    """(packed u8 [..., K/2], scale u8 [..., K/32]) -> float32 [..., K] (exact)."""
    vals = E2M1_LUT[unpack_codes(packed)]
    exps = np.repeat(scale.astype(np.int32) - 127, BLOCK, axis=-1)
    return np.ldexp(vals, exps).astype(np.float32)
