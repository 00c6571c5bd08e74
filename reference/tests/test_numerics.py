import torch

from k3ref import mxfp4
from k3ref.numerics import bf16, rounding, topk_lower_index


def test_bf16_single_rounding_from_fp64():
    # 1 + 2^-8 + 2^-40 lies just above the BF16 midpoint between 1 and 1 + 2^-7: must round up
    # (a float64 -> float32 -> bfloat16 cast rounds to 1.0).
    x = torch.tensor([1.0 + 2 ** -8 + 2 ** -40, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8 + 2 ** -40)],
                     dtype=torch.float64)
    assert bf16(x).tolist() == [1.0 + 2 ** -7, 1.0, 1.0 + 2 ** -6, -(1.0 + 2 ** -7)]


def test_bf16_matches_cast_on_random_fp32():
    x = torch.randn(10000, dtype=torch.float32)
    assert torch.equal(bf16(x.double()), x.to(torch.bfloat16).double())
    with rounding(False):
        assert torch.equal(bf16(x.double()), x.double())


def test_topk_ties_lower_index():
    s = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.5, 0.0]])
    assert topk_lower_index(s, 4).tolist() == [[1, 3, 4, 0]]
    z = torch.zeros(1, 100)
    assert topk_lower_index(z, 5).tolist() == [[0, 1, 2, 3, 4]]


def test_mxfp4_layout_and_lut():
    # byte 0x7A: low nibble 0xA (-1.0) is element 0, high nibble 0x7 (6.0) is element 1; scale 2^(128-127)
    packed = torch.tensor([[0x7A] + [0] * 15], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)
    w = mxfp4.dequant(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, 0] == -2.0 and w[0, 1] == 12.0 and w[0, 2:].abs().sum() == 0


def test_mxfp4_quantize_roundtrip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g, dtype=torch.float64)
    p, s = mxfp4.quantize(w)
    d = mxfp4.dequant(p, s)
    blocks = d.reshape(8, 2, 32).abs().amax(-1) / torch.ldexp(torch.ones(8, 2, dtype=torch.float64),
                                                               s.to(torch.float64) - 127)
    assert bool(((blocks >= 3) & (blocks <= 6)).all())        # §4 sanity: largest decoded magnitude in [3, 6]
    assert float((d - w).abs().max()) <= float(w.abs().max()) / 4 + 1e-12
    # exactly representable values survive, ties go to the even code: 2.5 -> 2 (code 4), 5 -> 4 (code 6)
    x = torch.tensor([[6.0, 2.5, 5.0, 0.25, 0.75, -1.25] + [0.0] * 26], dtype=torch.float64)
    p, s = mxfp4.quantize(x)
    assert s.item() == 127
    assert mxfp4.dequant(p, s)[0, :6].tolist() == [6.0, 2.0, 4.0, 0.0, 1.0, -1.0]
