#!/usr/bin/env python3
"""Print the measured agreement between the two KDA forms (recurrent / chunked WY-UT) and the two MLA forms
(naive / absorbed), on random inputs and on a checkpoint's layers.

    python3 reference/agreement.py --ckpt DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3ref import kda, mla  # noqa: E402
from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402
from k3ref.numerics import bf16, rounding  # noqa: E402
torch.set_num_threads(1)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def maxabs(a, b):
    return float((a.double() - b.double()).abs().max())


def rand_delta_inputs(T, H, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q = kda.l2norm(r(T, H, K)) * K ** -0.5
    k = kda.l2norm(r(T, H, K))
    v = r(T, H, K)
    gt = -5.0 * torch.sigmoid(2.0 * r(T, H, K))
    beta = torch.sigmoid(r(T, H))
    S0 = r(H, K, K)
    return [x.to(dtype) for x in (q, k, v, gt, beta, S0)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    print("KDA delta rule, random inputs (H=4, K=V=32, g in (-5,0), random initial state):")
    for dtype in (torch.float64, torch.float32):
        for T in (1, 63, 64, 65, 150, 300):
            a = rand_delta_inputs(T, 4, 32, dtype, T)
            o1, s1 = kda.delta_rule_recurrent(*a)
            o2, s2 = kda.delta_rule_chunked(*a, chunk=64)
            print(f"  {str(dtype):14s} T={T:3d}: out rel L2 {rel(o2, o1):.2e} max|d| {maxabs(o2, o1):.2e}; "
                  f"state rel L2 {rel(s2, s1):.2e}")
    ck = Checkpoint(args.ckpt)
    cfg = ck.cfg
    g = torch.Generator().manual_seed(0)
    x = bf16(torch.randn(150, cfg.hidden_size, generator=g, dtype=torch.float64))
    kdaL = [L for L in range(cfg.num_hidden_layers) if cfg.is_kda(L)][0]
    mlaL = [L for L in range(cfg.num_hidden_layers) if cfg.is_mla(L)][0]
    print(f"KDA layer {kdaL} of the checkpoint, 150 random BF16 inputs, chunked vs recurrent:")
    for rnd in (False, True):
        with rounding(rnd):
            s1, s2 = kda.new_state(cfg, torch.float64), kda.new_state(cfg, torch.float64)
            y1 = kda.kda_layer(ck, cfg, kdaL, x, s1, mode="recurrent")
            y2 = kda.kda_layer(ck, cfg, kdaL, x, s2, mode="chunked")
            diff = f", BF16 outputs differing {int((y1 != y2).sum())}/{y1.numel()}" if rnd else ""
            print(f"  BF16 rounding {'on ' if rnd else 'off'}: out rel L2 {rel(y2, y1):.2e}{diff}; "
                  f"state rel L2 {rel(s2['S'], s1['S']):.2e}")
    print(f"MLA layer {mlaL} of the checkpoint, 150 random BF16 inputs (index_topk {cfg.index_topk}), "
          "absorbed vs naive:")
    for rnd in (False, True):
        with rounding(rnd):
            s1, s2 = mla.new_state(cfg, torch.float64), mla.new_state(cfg, torch.float64)
            y1 = mla.mla_layer(ck, cfg, mlaL, x, s1, form="naive")
            y2 = mla.mla_layer(ck, cfg, mlaL, x, s2, form="absorbed")
            print(f"  BF16 rounding {'on ' if rnd else 'off'}: out rel L2 {rel(y2, y1):.2e} max|d| {maxabs(y2, y1):.2e}")
    toks = torch.randint(1, min(cfg.vocab_size, 700), (100,), generator=g).tolist()
    print("Whole model, 100 tokens, logits rel L2 vs default (naive MLA, chunked KDA), FP64 compute:")
    for rnd in (False, True):
        with rounding(rnd):
            base = Model(ck)
            ref = base.prefill(toks, base.new_state())
            for kw in ({"mla_form": "absorbed"}, {"kda_mode": "recurrent"}):
                m = Model(ck, **kw)
                out = m.prefill(toks, m.new_state())
                print(f"  BF16 rounding {'on ' if rnd else 'off'} {kw}: {rel(out, ref):.2e}")


if __name__ == "__main__":
    main()
