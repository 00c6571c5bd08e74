"""§3.3: recurrent (definition) == chunked WY/UT form; short conv; layer-level continuation."""
import pytest
import torch
import torch.nn.functional as F

from k3ref import kda
from k3ref.numerics import rounding

from conftest import rel


def rand_inputs(T, H=3, K=32, Vd=24, dtype=torch.float64, seed=0, with_state=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q = kda.l2norm(r(T, H, K)) * K ** -0.5
    k = kda.l2norm(r(T, H, K))
    v = r(T, H, Vd)
    gate = -5.0 * torch.sigmoid(2.0 * r(T, H, K))          # log decay in (-5, 0), as §3.3.4
    beta = torch.sigmoid(r(T, H))
    S0 = r(H, K, Vd) if with_state else torch.zeros(H, K, Vd, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, gate, beta, S0)]


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_equals_chunked_fp64(T, with_state):
    args = rand_inputs(T, with_state=with_state, seed=T)
    o1, s1 = kda.delta_rule_recurrent(*args)
    o2, s2 = kda.delta_rule_chunked(*args, chunk=64)
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12


def test_recurrent_equals_chunked_fp32():
    args = rand_inputs(150, dtype=torch.float32, seed=7)
    o1, s1 = kda.delta_rule_recurrent(*args)
    o2, s2 = kda.delta_rule_chunked(*args, chunk=64)
    assert rel(o2, o1) < 1e-5 and rel(s2, s1) < 1e-5


def test_strong_decay_no_overflow():
    # g near -5 everywhere: Γ reaches -320 inside a chunk; pairwise form must stay finite and exact
    q, k, v, g, beta, S0 = rand_inputs(128, seed=3)
    g = torch.full_like(g, -4.999)
    o1, s1 = kda.delta_rule_recurrent(q, k, v, g, beta, S0)
    o2, s2 = kda.delta_rule_chunked(q, k, v, g, beta, S0)
    assert torch.isfinite(o2).all() and rel(o2, o1) < 1e-12


def test_chunked_continuation():
    """Prefill continuation: running [0, a) then [a, T) from the carried state == one pass."""
    q, k, v, g, beta, S0 = rand_inputs(170, seed=11)
    o_full, s_full = kda.delta_rule_chunked(q, k, v, g, beta, S0)
    a = 77
    o_a, s_a = kda.delta_rule_chunked(q[:a], k[:a], v[:a], g[:a], beta[:a], S0)
    o_b, s_b = kda.delta_rule_chunked(q[a:], k[a:], v[a:], g[a:], beta[a:], s_a)
    assert rel(torch.cat([o_a, o_b]), o_full) < 1e-12 and rel(s_b, s_full) < 1e-12


def test_short_conv_definition():
    g = torch.Generator().manual_seed(0)
    T, C = 20, 6
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, 4, generator=g, dtype=torch.float64)
    with rounding(False):
        y, hist = kda.short_conv(x, w, torch.zeros(3, C, dtype=torch.float64))
        ref = F.silu(F.conv1d(F.pad(x.T.unsqueeze(0), (3, 0)), w, groups=C)[0].T)
        assert torch.allclose(y, ref, atol=1e-13)
        assert torch.equal(hist, x[-3:])
        # split in two calls (with 1-token pieces) == one call
        y1, h1 = kda.short_conv(x[:1], w, torch.zeros(3, C, dtype=torch.float64))
        y2, h2 = kda.short_conv(x[1:9], w, h1)
        y3, _ = kda.short_conv(x[9:], w, h2)
        assert torch.allclose(torch.cat([y1, y2, y3]), y, atol=1e-13)


@pytest.mark.parametrize("split", [1, 40, 64, 100])
def test_layer_recurrent_vs_chunked_and_continuation(ckpt, split):
    """Whole KDA layer (layer 0 of the fixture): chunked prefill == recurrent, also when split at `split`."""
    cfg = ckpt.cfg
    g = torch.Generator().manual_seed(split)
    from k3ref.numerics import bf16
    x = bf16(torch.randn(130, cfg.hidden_size, generator=g, dtype=torch.float64))
    st1, st2, st3 = (kda.new_state(cfg, torch.float64) for _ in range(3))
    y1 = kda.kda_layer(ckpt, cfg, 0, x, st1, mode="recurrent")
    y2 = kda.kda_layer(ckpt, cfg, 0, x, st2, mode="chunked")
    y3 = torch.cat([kda.kda_layer(ckpt, cfg, 0, x[:split], st3, mode="chunked"),
                    kda.kda_layer(ckpt, cfg, 0, x[split:], st3, mode="chunked")])
    # BF16 outputs: identical except for (very rare) rounding flips caused by ~1e-16 differences
    assert rel(y2, y1) < 1e-6 and rel(y3, y1) < 1e-6
    assert rel(st2["S"], st1["S"]) < 1e-12 and rel(st3["S"], st1["S"]) < 1e-12
