"""The reference DSpark draft (k3ref/dspark.py, MODEL.md §5): properties that do not need golden values, and the
committed tests/golden/nano-dspark data are reproduced bit for bit from freshly generated checkpoints."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "reference"))
from k3ref.dspark import Draft, rope_interleaved, rope_tables  # noqa: E402
from k3ref.model import Model  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden", "nano-dspark")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    subprocess.run([sys.executable, os.path.join(ROOT, "reference", "make_checkpoint.py"), "--config", "nano",
                    "--out", str(d / "nano"), "--seed", "1"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, os.path.join(ROOT, "reference", "make_draft.py"), "--config", "nano",
                    "--out", str(d / "draft"), "--seed", "1"], check=True)
    return str(d / "nano"), str(d / "draft")


@pytest.fixture(scope="module")
def pair(dirs):
    m = Model(dirs[0])
    dr = Draft(dirs[1], m)
    m.tap_layers = dr.cfg.target_layer_ids
    return m, dr


def test_rope_is_a_rotation(pair):
    _, dr = pair
    inv, mul, _ = rope_tables(dr.cfg)
    x = torch.randn(5, 16, dtype=torch.float64)
    x = x.to(torch.bfloat16).to(torch.float64)
    # position 0 leaves x unchanged (mul = 1 here); norms of each pair are kept up to BF16 rounding
    assert mul == 1.0
    assert torch.equal(rope_interleaved(x, torch.zeros(5, dtype=torch.int64), inv, mul), x)
    y = rope_interleaved(x, torch.arange(5) * 7, inv, mul)
    n0 = x.view(5, 8, 2).norm(dim=-1)
    n1 = y.view(5, 8, 2).norm(dim=-1)
    assert torch.allclose(n0, n1, rtol=1e-2)


def test_taps_are_the_partial_sums(pair):
    m, dr = pair
    cap = {}
    m.prefill([5, 6, 7, 8], m.new_state(), cap)
    D = m.cfg.hidden_size
    assert m.last_taps.shape == (4, D * len(dr.cfg.target_layer_ids))
    # layer 1 is not an AttnRes write layer (block size 3): P after it = attn_out0+mlp_out0 ... summed in order
    L = dr.cfg.target_layer_ids[0]
    P = cap["L0.attn_out"]
    from k3ref.numerics import bf16
    P = bf16(P + cap["L0.mlp_out"])
    for k in range(1, L + 1):
        P = bf16(P + cap[f"L{k}.attn_out"])
        P = bf16(P + cap[f"L{k}.mlp_out"])
    assert torch.equal(m.last_taps[:, :D], P)


def test_incremental_injection_and_block_leaves_state(pair):
    m, dr = pair
    toks = list(range(30, 50))
    m.prefill(toks, m.new_state())
    taps = m.last_taps
    a, b = dr.new_state(), dr.new_state()
    dr.inject(taps, a)
    dr.inject(taps[:7], b)
    dr.block_hidden([3, dr.cfg.mask_token_id, dr.cfg.mask_token_id], b)  # must not touch b
    dr.inject(taps[7:], b)
    for la, lb in zip(a["latent"], b["latent"]):
        assert torch.equal(la, lb)
    assert a["pos"] == b["pos"] == 20


def test_block_is_non_causal(pair):
    m, dr = pair
    m.prefill(list(range(40, 52)), m.new_state())
    st = dr.new_state()
    dr.inject(m.last_taps, st)
    mk = dr.cfg.mask_token_id
    h1 = dr.block_hidden([9, mk, mk, mk], st)
    h2 = dr.block_hidden([9, mk, mk, 17], st)
    # changing the last block token changes the first position's state (it attends to the whole block)
    assert not torch.equal(h1[0], h2[0])


def test_topk_pruning_masks_all_but_k(pair):
    m, dr = pair
    m.prefill(list(range(60, 70)), m.new_state())
    st = dr.new_state()
    dr.inject(m.last_taps, st)
    hn = dr.block_hidden([4] + [dr.cfg.mask_token_id] * 3, st)
    lg = dr.markov_logits(hn[0], 4, topk=8)
    assert int(torch.isfinite(lg).sum()) == 8
    full = dr.markov_logits(hn[0], 4)
    base_top = torch.sort(dr.base_logits(hn[0]), descending=True, stable=True).indices[:8]
    assert set(torch.nonzero(torch.isfinite(lg)).flatten().tolist()) == set(base_top.tolist())
    assert torch.equal(lg[base_top], full[base_top])


def test_committed_golden_reproduces(dirs):
    meta = json.load(open(os.path.join(GOLDEN, "golden.json")))
    from k3ref.loader import Checkpoint
    assert Checkpoint(dirs[0]).fingerprint() == meta["checkpoint"]["sha256"]
    stored = load_file(os.path.join(GOLDEN, "golden.safetensors"))
    m = Model(dirs[0])
    dr = Draft(dirs[1], m)
    m.tap_layers = dr.cfg.target_layer_ids
    m.prefill(meta["step1"]["prompt"], m.new_state())
    assert torch.equal(m.last_taps.to(torch.bfloat16), stored["step1.taps"])
    st = dr.new_state()
    dr.inject(m.last_taps, st)
    toks, logits = dr.draft_greedy(meta["step1"]["anchor"], st)
    assert toks == stored["step1.draft_tokens"].tolist()
    assert torch.equal(logits, stored["step1.draft_logits"])
