"""Whole model: config parsing, stateful prefill/decode, batches, forms."""
import json
import os

import pytest
import torch

from k3ref.config import load_config
from k3ref.fixture import write_checkpoint
from k3ref.model import Model
from k3ref.numerics import rounding

from conftest import prompt, rel


def test_layer_kinds_one_indexed(ckpt):
    cfg = ckpt.cfg
    assert [L for L in range(8) if cfg.is_mla(L)] == [3, 7]
    assert [L for L in range(8) if cfg.is_kda(L)] == [0, 1, 2, 4, 5, 6]
    assert [L for L in range(8) if cfg.is_moe(L)] == list(range(1, 8))
    assert cfg.num_blocks == 3


def test_prefill_then_decode_equals_long_prefill(model):
    toks = prompt(90, seed=1)                    # crosses the 64-token chunk and index_topk
    ref = model.prefill(toks, model.new_state())
    st = model.new_state()
    out = [model.prefill(toks[:70], st)]
    for t in toks[70:]:
        out.append(model.decode(t, st).unsqueeze(0))
    out = torch.cat(out)
    assert st["pos"] == 90
    assert rel(out, ref) < 1e-6
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_prefill_in_pieces_equals_one_prefill(model):
    toks = prompt(100, seed=2)
    ref = model.prefill(toks, model.new_state())
    st = model.new_state()
    out = torch.cat([model.prefill(toks[a:b], st) for a, b in [(0, 30), (30, 31), (31, 95), (95, 100)]])
    assert rel(out, ref) < 1e-6


def test_batch_equals_each_alone(model):
    reqs = [prompt(7, 3), prompt(33, 4), prompt(12, 5)]
    cap = {}
    batch = model.prefill_batch(reqs, capture=cap)
    alone = torch.cat([model.prefill(r, model.new_state()) for r in reqs])
    assert torch.equal(batch, alone)
    assert cap["logits"].shape == (52, 1024) and cap["L3.index_topk"].shape == (52, 64)


def test_capture_contents(model):
    cap = {}
    lg = model.prefill(prompt(10, 6), model.new_state(), cap)
    assert torch.equal(cap["logits"], lg)
    # layer 0: x_attn_in is the embedding itself (single-source Mix)
    assert torch.equal(cap["L0.attn_in"], model.ck.get("model.embed_tokens.weight")[torch.tensor(prompt(10, 6))])
    for k, v in cap.items():
        if v.is_floating_point() and k != "logits" and not k.endswith(("router_weights", "_margin")):
            assert torch.equal(v, v.to(torch.bfloat16).to(v.dtype)), k      # BF16 values
    w = cap["L1.router_weights"]
    assert torch.allclose(w.double().sum(-1), torch.ones(10, dtype=torch.float64), atol=1e-6)


def test_model_variants_agree_without_rounding(ckpt):
    """Whole model, BF16 roundings off: absorbed MLA / recurrent KDA / other chunk sizes == default.
    (With roundings on, the random fixture is chaotic — router/indexer flips — see README.)"""
    toks = prompt(80, seed=7)
    with rounding(False):
        base = Model(ckpt)
        ref = base.prefill(toks, base.new_state())
        for kw in ({"mla_form": "absorbed"}, {"kda_mode": "recurrent"}, {"kda_chunk": 16}):
            m = Model(ckpt, **kw)
            out = m.prefill(toks, m.new_state())
            assert rel(out, ref) < 1e-6, kw


def test_model_variants_with_rounding_first_layers(ckpt, model):
    """Roundings on: the variants still agree layer by layer before any discrete (router) decision flips."""
    toks = prompt(80, seed=7)
    ref = {}
    model.prefill(toks, model.new_state(), ref)
    for kw in ({"mla_form": "absorbed"}, {"kda_mode": "recurrent"}):
        m = Model(ckpt, **kw)
        cap = {}
        m.prefill(toks, m.new_state(), cap)
        assert rel(cap["L0.attn_out"], ref["L0.attn_out"]) < 1e-3, kw


def test_float32_compute_close(nano_dir, model):
    """float32 compute, roundings off, vs float64: agree closely (no BF16 flips to amplify)."""
    toks = prompt(40, seed=8)
    with rounding(False):
        m64 = Model(nano_dir)
        ref = m64.prefill(toks, m64.new_state())
        m32 = Model(nano_dir, dtype=torch.float32)
        out = m32.prefill(toks, m32.new_state())
    assert rel(out, ref) < 1e-4


def test_indexer_rope_option(tmp_path):
    d = write_checkpoint(str(tmp_path / "rope"), overrides={"index_rope_head_dim": 16, "index_topk": 16,
                                                            "num_hidden_layers": 4,
                                                            "linear_attn_config": {"kda_layers": [1, 2, 3],
                                                                                   "full_attn_layers": [4]}},
                         seed=1, n_shards=1)
    assert load_config(d).index_rope_head_dim == 16
    m = Model(d)
    toks = prompt(40, seed=9)
    ref = m.prefill(toks, m.new_state())
    st = m.new_state()
    out = torch.cat([m.prefill(toks[:25], st)] + [m.decode(t, st).unsqueeze(0) for t in toks[25:]])
    assert rel(out, ref) < 1e-6


def test_bad_layer_lists_rejected(tmp_path):
    from k3ref.fixture import NANO
    tc = json.loads(json.dumps(NANO))
    tc["linear_attn_config"]["full_attn_layers"] = [3, 8]   # 3 twice, 4 missing
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"text_config": tc}, f)
    with pytest.raises(ValueError):
        load_config(str(tmp_path))


def test_every_text_tensor_is_used(nano_dir):
    """After a long prompt (every expert gets routed to), every language_model.* tensor has been read."""
    from k3ref.loader import Checkpoint
    ck = Checkpoint(nano_dir)
    m = Model(ck)
    m.prefill(prompt(150, seed=10), m.new_state())
    assert ck.text_tensor_names() - ck.used == set()
