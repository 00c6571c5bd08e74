#!/usr/bin/env python3
"""How often do quantised index keys (FP8 / MXFP4, MODEL.md §3.5) change the DSA indexer's top-k, and are
the changes confined to near-ties?

Runs the reference model (k3ref, float32) over a prompt, records every MLA layer's indexer inputs (q_I, w,
k_I), and re-scores with the keys quantised as the paged cache stores them. For each query row with more
than index_topk visible keys it reports
  - agreement: |S_quant ∩ S_bf16| / topk (the engine's test measures the same thing in C++);
  - band agreement: the same, counting only keys whose BF16 score lies outside the row's quantisation band
    |I_bf16 − threshold| > max_s |I_quant − I_bf16| (a swap inside the band is a near-tie that the format's
    own rounding decides; outside it, a swap would be a real ranking error);
  - zeros: the fraction of visible keys whose score is exactly 0 (every head's ReLU cut it off).

    python3 reference/index_agreement.py --ckpt models/k3-tiny --eval-set models/k3-tiny/eval/passkey.jsonl \
        --min-context 4096
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "train"))

from k3ref import mla  # noqa: E402
from k3ref.model import Model  # noqa: E402


def fp8_keys(k):
    """§3.5 FP8: per token s = 2^ceil(log2(max(amax, 1e-4)/448)), e4m3 = RNE(k/s)."""
    amax = k.abs().amax(dim=1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (k / s).to(torch.float8_e4m3fn).to(k.dtype) * s


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_keys(k):
    """§3.5 MXFP4: 32-element blocks, s = 2^clamp(ceil(log2(max(amax, 6·2^-126)/6)), -127, 127), E2M1 RNE
    saturating (ties to the even code)."""
    T, D = k.shape
    b = k.view(T, D // 32, 32)
    amax = b.abs().amax(dim=2, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = torch.exp2(torch.clamp(torch.ceil(torch.log2(amax / 6.0)), -127, 127))
    x = (b / s).abs().clamp(max=6.0)
    grid = E2M1.to(k.dtype)
    d = (x.unsqueeze(-1) - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    # RNE: among equally near codes take the even code index (0, 2, 4, 6 are the even mantissas).
    cand = (d == best) & (torch.arange(8) % 2 == 0)
    idx = torch.where(cand.any(-1), cand.float().argmax(-1), d.argmin(-1))
    return (grid[idx] * torch.sign(b) * s).view(T, D)


def scores(cfg, qI, w, keys, pos):
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    dots = torch.relu(torch.einsum("thd,sd->ths", qI, keys))
    I = torch.einsum("th,ths->ts", w * (Hi ** -0.5 * Di ** -0.5), dots)
    causal = torch.arange(keys.shape[0]).unsqueeze(0) <= pos.unsqueeze(1)
    return torch.where(causal, I, torch.full_like(I, -torch.inf)), causal


def topk_set(I, k):
    # ties toward the lower key index, as the engine and k3ref do: stable sort on -score
    order = torch.sort(-I, dim=1, stable=True).indices[:, :k]
    return order


def analyse(cfg, rec):
    topk = cfg.index_topk
    qI, w, kb, pos = rec
    out = {}
    Ib, causal = scores(cfg, qI, w, kb, pos)
    rows = (pos + 1) > topk
    Ib, causal, qI, w, posr = Ib[rows], causal[rows], qI[rows], w[rows], pos[rows]
    sel_b = topk_set(Ib, topk)
    srt = torch.gather(Ib, 1, sel_b)
    thr = srt[:, -1:]
    zeros = float(((Ib == 0) & causal).sum() / causal.sum())
    for name, q in (("fp8", fp8_keys), ("mxfp4", mxfp4_keys)):
        Iq, _ = scores(cfg, qI, w, q(kb), posr)
        sel_q = topk_set(Iq, topk)
        mb = torch.zeros_like(Ib, dtype=torch.bool).scatter_(1, sel_b, True)
        mq = torch.zeros_like(Ib, dtype=torch.bool).scatter_(1, sel_q, True)
        agree = float((mb & mq).sum()) / (mb.shape[0] * topk)
        band = (torch.where(causal, (Iq - Ib).abs(), torch.zeros_like(Ib))).amax(dim=1, keepdim=True)
        outside = causal & ((Ib - thr).abs() > band)
        # keys outside the band: selected by bf16 (above the threshold) must stay selected, and vice versa
        cnt = (outside & mb).sum()
        kept = (outside & mb & mq).sum()
        wrong_in = (outside & ~mb & mq).sum()
        out[name] = dict(agreement=agree, band_selected=int(cnt), band_kept=int(kept),
                         band_agreement=float(kept) / max(int(cnt), 1), band_false_inclusions=int(wrong_in),
                         mean_band_over_threshold=float((band / thr.abs().clamp_min(1e-30)).mean()))
    out["zero_score_fraction"] = zeros
    out["rows"] = int(rows.sum())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--eval-set", required=True, help="JSONL eval set (docs/eval.md); chat requests")
    ap.add_argument("--min-context", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=1)
    args = ap.parse_args()
    from k3data.chat import Tokenizer, encode_chat  # train/k3data: the engine's chat format in Python
    tok = Tokenizer(args.ckpt)
    m = Model(args.ckpt, dtype=torch.float32, mla_form="naive")
    recs = []
    orig = mla.indexer_select

    def spy(cfg, qI, w, ikeys, pos):
        recs.append((qI.float(), w.float(), ikeys.float(), pos.clone()))
        return orig(cfg, qI, w, ikeys, pos)

    mla.indexer_select = spy
    n = 0
    with open(args.eval_set) as f:
        for line in f:
            item = json.loads(line)
            if item["meta"].get("context_tokens", 0) < args.min_context:
                continue
            req = item["request"]
            ids = encode_chat(tok, req["messages"], tools=req.get("tools"), reasoning_effort=req.get("reasoning_effort"))
            recs.clear()
            with torch.no_grad():
                m.prefill(ids, m.new_state())
            for i, rec in enumerate(recs):
                print(json.dumps({"item": item["id"], "tokens": len(ids), "mla_layer_call": i, **analyse(m.cfg, rec)}))
            n += 1
            if n >= args.limit:
                break


if __name__ == "__main__":
    main()
