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
    grid = E2M1.to(device=k.device, dtype=k.dtype)
    d = (x.unsqueeze(-1) - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    # RNE: among equally near codes take the even code index (0, 2, 4, 6 are the even mantissas).
    cand = (d == best) & (torch.arange(8, device=k.device) % 2 == 0)
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


def analyse(cfg, rec, rows_per_block=2048):
    """Counts over every query row with more than index_topk visible keys, in blocks of rows so that a 32K or
    64K context fits in memory (the scores are [rows, S] per block, the per-head dots [rows, H_I, S])."""
    topk = cfg.index_topk
    qI, w, kb, pos = rec
    keep = (pos + 1) > topk
    qI, w, pos = qI[keep], w[keep], pos[keep]
    quant = {"fp8": fp8_keys(kb), "mxfp4": mxfp4_keys(kb)}
    acc = {n: dict(agree=0, band_selected=0, band_kept=0, band_false_inclusions=0, band_over_thr=0.0) for n in quant}
    zeros = visible = 0
    for r0 in range(0, qI.shape[0], rows_per_block):
        sl = slice(r0, r0 + rows_per_block)
        Ib, causal = scores(cfg, qI[sl], w[sl], kb, pos[sl])
        sel_b = topk_set(Ib, topk)
        thr = torch.gather(Ib, 1, sel_b)[:, -1:]
        zeros += int(((Ib == 0) & causal).sum())
        visible += int(causal.sum())
        mb = torch.zeros_like(Ib, dtype=torch.bool).scatter_(1, sel_b, True)
        for name, kq in quant.items():
            Iq, _ = scores(cfg, qI[sl], w[sl], kq, pos[sl])
            mq = torch.zeros_like(Ib, dtype=torch.bool).scatter_(1, topk_set(Iq, topk), True)
            band = torch.where(causal, (Iq - Ib).abs(), torch.zeros_like(Ib)).amax(dim=1, keepdim=True)
            # keys outside the band: selected by bf16 (above the threshold) must stay selected, and vice versa
            outside = causal & ((Ib - thr).abs() > band)
            a = acc[name]
            a["agree"] += int((mb & mq).sum())
            a["band_selected"] += int((outside & mb).sum())
            a["band_kept"] += int((outside & mb & mq).sum())
            a["band_false_inclusions"] += int((outside & ~mb & mq).sum())
            a["band_over_thr"] += float((band / thr.abs().clamp_min(1e-30)).sum())
    n = int(qI.shape[0])
    out = {}
    for name, a in acc.items():
        out[name] = dict(agreement=a["agree"] / max(n * topk, 1), band_selected=a["band_selected"],
                         band_kept=a["band_kept"], band_agreement=a["band_kept"] / max(a["band_selected"], 1),
                         band_false_inclusions=a["band_false_inclusions"],
                         mean_band_over_threshold=a["band_over_thr"] / max(n, 1))
    out["zero_score_fraction"] = zeros / max(visible, 1)
    out["rows"] = n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--eval-set", required=True, help="JSONL eval set (docs/eval.md); chat requests")
    ap.add_argument("--min-context", type=int, default=4096)
    ap.add_argument("--max-context", type=int, default=1 << 30)
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    if args.device == "cuda":
        # k3ref allocates with torch's factory functions and no device argument (as reference/eval_ref.py)
        torch.set_default_device("cuda")
    # imported after the default device is set: k3ref builds lookup tables at import time
    from k3ref import mla
    from k3ref.model import Model
    from k3data.chat import Tokenizer, encode_chat  # train/k3data: the engine's chat format in Python
    tok = Tokenizer(args.ckpt)
    m = Model(args.ckpt, dtype=torch.float32, mla_form="naive")
    if args.device == "cuda":
        m.ck._raw = {k: v.to("cuda") for k, v in m.ck._raw.items()}
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
            if not args.min_context <= item["meta"].get("context_tokens", 0) <= args.max_context:
                continue
            req = item["request"]
            ids = encode_chat(tok, req["messages"], tools=req.get("tools"), reasoning_effort=req.get("reasoning_effort"))
            recs.clear()
            with torch.no_grad():
                st = m.new_state()
                for i in range(0, len(ids), 2048):  # chunked prefill: k3ref's naive MLA is [chunk, H, S]
                    m.prefill(ids[i:i + 2048], st)
            # one record per (prefill chunk, MLA layer): join each layer's chunks into one [T] record
            nl = len(recs) // ((len(ids) + 2047) // 2048)
            for i in range(nl):
                parts = recs[i::nl]
                rec = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[-1][2],
                       torch.cat([p[3] for p in parts]))
                print(json.dumps({"item": item["id"], "tokens": len(ids), "mla_layer": i, **analyse(m.cfg, rec)}),
                      flush=True)
            n += 1
            if n >= args.limit:
                break


if __name__ == "__main__":
    main()
