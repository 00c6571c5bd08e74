"""k3ref/vision.py (MODEL.md §6) against PyTorch's own operators, and its structural properties."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3ref import vision

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("src,dst", [((8, 8), (2, 2)), ((8, 8), (4, 6)), ((8, 8), (12, 10)), ((64, 64), (74, 74)),
                                     ((5, 7), (5, 7)), ((3, 9), (11, 2))])
def test_bilinear_resize_is_torch_interpolate(src, dst):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(*src, 5, generator=g, dtype=torch.float64)
    want = F.interpolate(table.permute(2, 0, 1)[None], size=dst, mode="bilinear", align_corners=False)[0]
    got = vision.bilinear_resize(table.numpy(), *dst)
    np.testing.assert_allclose(got, want.permute(1, 2, 0).numpy(), rtol=0, atol=1e-12)


def test_bf16_is_a_single_correct_rounding():
    from k3ref.numerics import bf16 as tbf16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100000, generator=g, dtype=torch.float64) * torch.exp(torch.randn(100000, generator=g) * 5)
    # values that float32 rounding would put exactly on a BF16 midpoint
    mids = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -40, 1.0 + 2.0 ** -8 - 2.0 ** -40, -(3.0 + 3 * 2.0 ** -7)],
                        dtype=torch.float64)
    x = torch.cat([x, mids])
    np.testing.assert_array_equal(vision.bf16(x.numpy()), tbf16(x).numpy())


def test_gelus_are_torch_gelus():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    np.testing.assert_allclose(vision.gelu_tanh(x.numpy()), F.gelu(x, approximate="tanh").numpy(), atol=1e-14)
    np.testing.assert_allclose(vision.gelu_erf(x.numpy()), F.gelu(x).numpy(), atol=1e-14)


def test_rope_2d_pairs_and_frequencies():
    hd = 16
    x = np.zeros((1, 1, hd))
    x[..., 0::2] = 1.0                                  # every pair = 1 + 0i
    r, c = np.array([3.0]), np.array([5.0])
    y = vision.rope_2d(x, r, c)[0, 0]
    for j in range(hd // 2):
        i, pos = j // 2, (c[0] if j % 2 == 0 else r[0])
        ang = pos * 10000.0 ** (-4.0 * i / hd)
        assert math.isclose(y[2 * j], math.cos(ang), abs_tol=1e-15)
        assert math.isclose(y[2 * j + 1], math.sin(ang), abs_tol=1e-15)


def test_merge_order():
    gh, gw = 4, 6
    x = np.arange(gh * gw, dtype=np.float64)[:, None]    # value = grid index
    m = vision.merge_2x2(x, gh, gw)
    assert m.shape == (6, 4)
    # merged token (1, 2): TL = (2, 4), TR = (2, 5), BL = (3, 4), BR = (3, 5)
    assert m[1 * 3 + 2].tolist() == [2 * 6 + 4, 2 * 6 + 5, 3 * 6 + 4, 3 * 6 + 5]


@pytest.fixture(scope="module")
def vnano(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("vnano"))
    subprocess.check_call([sys.executable, os.path.join(ROOT, "reference", "make_checkpoint.py"), "--config", "nano",
                           "--out", d, "--seed", "3"], stdout=subprocess.DEVNULL)
    return vision.VisionWeights(d)


def test_images_do_not_see_each_other(vnano):
    rng = np.random.default_rng(0)
    a = vision.bf16(rng.uniform(-1, 1, (4 * 6, 588)))
    b = vision.bf16(rng.uniform(-1, 1, (2 * 2, 588)))
    alone = vision.encode_image(vnano, a, 4, 6)
    both = vision.encode(vnano, [(b, 2, 2), (a, 4, 6)])
    np.testing.assert_array_equal(both[1:], alone)
    # a patch's content matters to every token of its image (full attention), and only to its own image
    a2 = a.copy()
    a2[0] += 0.25
    moved = vision.encode_image(vnano, a2, 4, 6)
    assert (np.abs(moved - alone).max(axis=1) > 0).all()


def test_no_vision_checkpoint_is_refused(tmp_path):
    subprocess.check_call([sys.executable, os.path.join(ROOT, "reference", "make_checkpoint.py"), "--config", "nano",
                           "--out", str(tmp_path), "--seed", "3", "--no-vision"], stdout=subprocess.DEVNULL)
    with pytest.raises(ValueError, match="no vision_config"):
        vision.VisionWeights(str(tmp_path))


def test_committed_vision_golden_regenerates_bit_for_bit(tmp_path):
    """tests/golden/nano-vision: the stored image rows are what k3ref/vision.py computes now (seed-1 nano)."""
    import json
    from safetensors.torch import load_file
    gdir = os.path.join(ROOT, "tests", "golden", "nano-vision")
    meta = json.load(open(os.path.join(gdir, "golden.json")))
    t = load_file(os.path.join(gdir, "golden.safetensors"))
    subprocess.check_call([sys.executable, os.path.join(ROOT, "reference", "make_checkpoint.py"), "--config", "nano",
                           "--out", str(tmp_path), "--seed", "1"], stdout=subprocess.DEVNULL)
    vw = vision.VisionWeights(str(tmp_path))
    for im in meta["images"]:
        i, gh, gw = im["index"], im["grid_h"], im["grid_w"]
        cap = {}
        vision.encode_image(vw, t[f"img{i}.patches"].double().numpy(), gh, gw, cap)
        for k, v in cap.items():
            np.testing.assert_array_equal(v, t[f"img{i}.{k}"].double().numpy(), err_msg=f"img{i}.{k}")
