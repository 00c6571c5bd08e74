"""make_golden.py on the fixture checkpoint: names, dtypes, shapes, json contents."""
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import make_golden  # noqa: E402


def test_golden_layout(nano_dir, tmp_path):
    out = str(tmp_path / "g")
    make_golden.main(["--ckpt", nano_dir, "--out", out, "--name", "fixture", "--no-sensitivity"])
    meta = json.load(open(os.path.join(out, "golden.json")))
    t = load_file(os.path.join(out, meta["tensor_file"]))
    assert set(meta["checkpoint"]["sha256"]) >= {"config.json", "model.safetensors.index.json"}
    V, D, K, topk = 1024, 256, 4, 64
    names = {c["name"]: c for c in meta["cases"]}
    assert [names[n]["num_tokens"] for n in ("short", "medium", "long", "batch", "prefill_decode")] == \
        [8, 40, 150, 44, 28]
    assert names["batch"]["lengths"] == [5, 12, 27]
    assert sorted(k for c in meta["cases"] for k in c["tensors"]) == sorted(t)
    specials = {1020, 1021, 1023}
    for c in meta["cases"]:
        T = c["num_tokens"]
        toks = c.get("tokens") or sum(c["requests"], [])
        assert len(toks) == T and all(0 < i < V - 256 and i not in specials for i in toks)
        n = c["name"]
        assert t[f"{n}.logits"].dtype == torch.float32 and t[f"{n}.logits"].shape == (T, V)
        assert t[f"{n}.final_hidden"].dtype == torch.bfloat16 and t[f"{n}.final_hidden"].shape == (T, D)
        for L in range(8):
            for k in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
                assert t[f"{n}.L{L}.{k}"].dtype == torch.bfloat16 and t[f"{n}.L{L}.{k}"].shape == (T, D)
            if L in (3, 7):
                assert t[f"{n}.L{L}.index_topk"].dtype == torch.int32
                assert t[f"{n}.L{L}.index_topk"].shape == (T, topk)
                assert t[f"{n}.L{L}.index_margin"].shape == (T,)
            else:
                assert f"{n}.L{L}.index_topk" not in t
            if L >= 1:
                assert t[f"{n}.L{L}.router_ids"].dtype == torch.int32 and t[f"{n}.L{L}.router_ids"].shape == (T, K)
                assert t[f"{n}.L{L}.router_weights"].dtype == torch.float32
                assert t[f"{n}.L{L}.router_margin"].shape == (T,)
            else:
                assert f"{n}.L{L}.router_ids" not in t
    # long case: the indexer selects (fewer than all visible keys) for queries past index_topk
    idx = t["long.L3.index_topk"]
    assert bool((idx[100] >= 0).all()) and int(idx[100].max()) <= 100
    pd = names["prefill_decode"]
    assert pd["prefill_len"] == 20 and pd["tokens"][20:] == pd["decode_tokens"]
    # decode token i is the greedy prediction of row 19+i
    lg = t["prefill_decode.logits"]
    for i, tok in enumerate(pd["decode_tokens"]):
        assert tok == 1 + int(lg[19 + i, 1:V - 256].argmax())
    assert os.path.getsize(os.path.join(out, meta["tensor_file"])) < 6.2e6
