"""§3.4 naive == absorbed MLA; §3.5 indexer: sparse == dense when topk ≥ context, differs when small, ties."""
import dataclasses

import torch

from k3ref import mla
from k3ref.numerics import bf16, rounding

from conftest import rel

MLA_LAYER = 3  # 1-indexed 4 in full_attn_layers


def run_layer(ckpt, x, form, topk=None, split=None, cfg=None):
    cfg = cfg or ckpt.cfg
    st = mla.new_state(cfg, torch.float64)
    if split is None:
        return mla.mla_layer(ckpt, cfg, MLA_LAYER, x, st, form=form, topk_override=topk)
    outs = [mla.mla_layer(ckpt, cfg, MLA_LAYER, x[a:b], st, form=form, topk_override=topk)
            for a, b in zip([0] + split, split + [x.shape[0]])]
    return torch.cat(outs)


def rand_x(cfg, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return bf16(torch.randn(T, cfg.hidden_size, generator=g, dtype=torch.float64))


def test_naive_equals_absorbed_without_rounding(ckpt):
    x = rand_x(ckpt.cfg, 90)
    with rounding(False):
        a = run_layer(ckpt, x, "naive")
        b = run_layer(ckpt, x, "absorbed")
    assert rel(b, a) < 1e-12


def test_naive_close_to_absorbed_with_bf16(ckpt):
    x = rand_x(ckpt.cfg, 90, seed=1)
    a = run_layer(ckpt, x, "naive")
    b = run_layer(ckpt, x, "absorbed")
    assert rel(b, a) < 1e-2          # differ only through BF16 rounding of k_nope / v in the naive form


def test_absorbed_decode_equals_naive_prefill(ckpt):
    """Decode one token at a time with the absorbed form over the cache == naive prefill (rounding off)."""
    x = rand_x(ckpt.cfg, 70, seed=2)
    with rounding(False):
        a = run_layer(ckpt, x, "naive")
        b = run_layer(ckpt, x, "absorbed", split=list(range(1, 70)))
    assert rel(b, a) < 1e-12


def test_sparse_equals_dense_when_topk_covers_context(ckpt):
    x = rand_x(ckpt.cfg, 60, seed=3)          # 60 ≤ index_topk = 64
    sparse = run_layer(ckpt, x, "naive")
    cfg_dense = dataclasses.replace(ckpt.cfg, index_topk=0)   # no indexer -> dense causal
    dense = run_layer(ckpt, x, "naive", cfg=cfg_dense)
    assert torch.equal(sparse, dense)
    big = run_layer(ckpt, rand_x(ckpt.cfg, 150, seed=4), "naive", topk=4096)
    dense_big = run_layer(ckpt, rand_x(ckpt.cfg, 150, seed=4), "naive", cfg=cfg_dense)
    assert torch.equal(big, dense_big)


def test_sparse_differs_when_topk_small(ckpt):
    x = rand_x(ckpt.cfg, 150, seed=5)
    cfg_dense = dataclasses.replace(ckpt.cfg, index_topk=0)
    dense = run_layer(ckpt, x, "naive", cfg=cfg_dense)
    sparse = run_layer(ckpt, x, "naive")                      # topk 64 < 150
    assert torch.equal(sparse[:64], dense[:64])                # first 64 queries see ≤ 64 keys
    assert rel(sparse[64:], dense[64:]) > 1e-3
    tiny = run_layer(ckpt, x, "naive", topk=4)
    assert torch.equal(tiny[:4], dense[:4]) and rel(tiny[4:], dense[4:]) > 1e-2


def test_indexer_selection_contract(ckpt):
    cfg = ckpt.cfg
    x = rand_x(cfg, 150, seed=6)
    st = mla.new_state(cfg, torch.float64)
    cap = {}
    mla.mla_layer(ckpt, cfg, MLA_LAYER, x, st, capture=cap)
    idx = cap["index_topk"]
    assert idx.dtype == torch.int32 and idx.shape == (150, cfg.index_topk)
    for t in range(150):
        row = idx[t][idx[t] >= 0]
        assert row.numel() == min(cfg.index_topk, t + 1)
        assert bool((row <= t).all()) and bool((row[1:] > row[:-1]).all())   # ascending, unique, causal
        assert bool((idx[t][row.numel():] == -1).all())
        if t < cfg.index_topk:
            assert row.tolist() == list(range(t + 1))
    assert st["ikey"].shape == (150, cfg.index_head_dim)


def test_indexer_ties_to_lower_index():
    cfg = type("C", (), {})()
    cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk = 2, 4, 3
    qI = -torch.ones(1, 2, 4, dtype=torch.float64)            # all ReLU scores 0 -> all tied
    keys = torch.ones(10, 4, dtype=torch.float64)
    w = torch.ones(1, 2, dtype=torch.float64)
    idx, scores, margin = mla.indexer_select(cfg, qI, w, keys, torch.tensor([9]))
    assert idx.tolist() == [[0, 1, 2]] and bool((scores[0] == 0).all()) and margin.tolist() == [0.0]
