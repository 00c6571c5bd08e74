#!/usr/bin/env python3
"""Measure how well-conditioned a checkpoint is under BF16 activations, on the golden prompts.

    python3 reference/conditioning.py --ckpt DIR [--trials N] [--cases short,medium,...]

Per golden case (same prompts as reference/make_golden.py; prefill_decode is run as one prefill of its 28
tokens, which the reference agrees with to < 1e-5):
- fp32: the reference run in FP32 instead of FP64 (same rounding points) — logits rel. L2 (all rows / worst
  row), greedy agreement, router / indexer rows whose selection differs;
- ulp: in the FP64 run, ONE element of `L{L}.mlp_out` (or of the RMSNorm'd MLP input) raised by one BF16 ulp
  (random row/column, per layer in --ulp-layers, --trials times each) — the largest logits rel. L2 (all rows /
  worst row) and greedy changes;
- margins: router margin (biased score of the K-th chosen − best unchosen expert), indexer margin, and the
  greedy logit gap (top-1 − top-2) relative to the row's logit RMS: minimum and 1st percentile;
- scale: ||layer output|| / ||layer input (Mix result)|| per layer (attention and MLP), median over rows;
- diversity: distinct experts used and distinct expert sets per MoE layer.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402
from make_golden import allowed_ids, make_prompt  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def worst_row(a, b):
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-300)).max())


def ulp_up(t, row, col):
    t = t.clone()
    b = t[row, col].to(torch.bfloat16).view(torch.int16)
    t[row, col] = (b + 1).view(torch.bfloat16).to(t.dtype)        # |x| up one BF16 ulp (x is BF16-exact)
    return t


class PerturbedModel(Model):
    """FP64 model that raises element (row, col) of layer `layer`'s MLP output (target "out") or of its
    RMSNorm'd input (target "in") by one BF16 ulp."""

    def __init__(self, ck, layer, row, col, target="out"):
        super().__init__(ck)
        self.p_layer, self.p_row, self.p_col, self.target = layer, row, col, target

    def _mlp(self, L, x, cap):
        hit = L == self.p_layer and 0 <= self.p_row < x.shape[0]
        if hit and self.target == "in":
            x = ulp_up(x, self.p_row, self.p_col)
        m = super()._mlp(L, x, cap)
        return ulp_up(m, self.p_row, self.p_col) if hit and self.target == "out" else m


def cases(ck, model):
    allowed = allowed_ids(ck)
    topk = ck.cfg.index_topk
    long_len = max(150, topk + 86) if topk else 150
    out = [("short", [make_prompt(allowed, 8, 1)]), ("medium", [make_prompt(allowed, 40, 2)]),
           ("long", [make_prompt(allowed, long_len, 3)]),
           ("batch", [make_prompt(allowed, 5, 4), make_prompt(allowed, 12, 5), make_prompt(allowed, 27, 6)])]
    prompt = make_prompt(allowed, 20, 7)
    mask = torch.full((ck.cfg.vocab_size,), -torch.inf)
    mask[allowed] = 0.0
    st = model.new_state()
    row = model.prefill(prompt, st)[-1]
    toks = list(prompt)
    for _ in range(8):
        nxt = int((row + mask).argmax())
        toks.append(nxt)
        row = model.decode(nxt, st)
    out.append(("prefill_decode", [toks]))
    return out


def q(t, p):
    t = t.double().flatten()
    t = t[torch.isfinite(t)]
    return float(torch.quantile(t, p)) if t.numel() else float("inf")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--trials", type=int, default=4, help="1-ulp perturbations per (case, layer)")
    ap.add_argument("--ulp-layers", default="0,3,6", help="layers whose mlp_out is perturbed")
    ap.add_argument("--ulp-target", default="out,in",
                    help="out: perturb L{L}.mlp_out (often absorbed when P + m is rounded); in: perturb the "
                         "RMSNorm'd MLP input (a stream-scale value)")
    ap.add_argument("--cases", default="short,medium,long,batch,prefill_decode")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ck = Checkpoint(args.ckpt, torch.float64)
    cfg = ck.cfg
    m64 = Model(ck)
    m32 = Model(args.ckpt, dtype=torch.float32)
    D = cfg.hidden_size
    want = set(args.cases.split(","))
    ulp_layers = [int(x) for x in args.ulp_layers.split(",") if x != ""]
    g = torch.Generator().manual_seed(99)
    summary = []
    for name, reqs in cases(ck, m64):
        if name not in want:
            continue
        cap64, cap32 = {}, {}
        ref = m64.prefill_batch(reqs, capture=cap64)
        out32 = m32.prefill_batch(reqs, capture=cap32)
        T = ref.shape[0]
        greedy = ref.argmax(-1)
        rdiff = sum(int((cap32[k] != cap64[k]).any(-1).sum()) for k in cap64 if k.endswith("router_ids"))
        idiff = sum(int((cap32[k] != cap64[k]).any(-1).sum()) for k in cap64 if k.endswith("index_topk"))
        print(f"== {name} ({T} rows)")
        f32 = (rel(out32, ref), worst_row(out32, ref), int((out32.argmax(-1) == greedy).sum()))
        print(f"  fp32 vs fp64: logits rel {f32[0]:.2e} worst row {f32[1]:.2e} greedy {f32[2]}/{T}"
              f"  router rows differing {rdiff}, indexer rows differing {idiff}")
        worst_ulp = (0.0, 0.0, T)
        for L, target in [(L, tg) for L in ulp_layers for tg in args.ulp_target.split(",")]:
            vals = []
            for _ in range(args.trials):
                r = int(torch.randint(0, T, (1,), generator=g))
                c = int(torch.randint(0, D, (1,), generator=g))
                pm = PerturbedModel(ck, L, r, c, target)
                # prefill_batch flattens requests: perturb within the request holding row r
                out, off = [], 0
                for toks in reqs:
                    pm.p_row = r - off
                    out.append(pm.prefill(toks, pm.new_state()))
                    off += len(toks)
                out = torch.cat(out)
                vals.append((rel(out, ref), worst_row(out, ref), int((out.argmax(-1) == greedy).sum())))
            mx = max(v[0] for v in vals)
            wr = max(v[1] for v in vals)
            gm = min(v[2] for v in vals)
            print(f"  1-ulp L{L}.mlp_{target}: logits rel max {mx:.2e} (median {sorted(v[0] for v in vals)[len(vals) // 2]:.2e})"
                  f" worst row {wr:.2e} greedy min {gm}/{T}")
            worst_ulp = (max(worst_ulp[0], mx), max(worst_ulp[1], wr), min(worst_ulp[2], gm))
        rm = torch.cat([cap64[k].flatten() for k in cap64 if k.endswith("router_margin")])
        im = torch.cat([cap64[k].flatten() for k in cap64 if k.endswith("index_margin")])
        lg = ref.double()
        top2 = lg.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]) / lg.pow(2).mean(-1).sqrt()
        print(f"  router margin: min {rm.min():.2e} p1 {q(rm, 0.01):.2e} median {q(rm, 0.5):.2e}"
              f" rows<1e-3 {int((rm < 1e-3).sum())}/{rm.numel()}")
        fin = im[torch.isfinite(im)]
        if fin.numel():
            print(f"  index margin: finite rows {fin.numel()}/{im.numel()} min {fin.min():.2e} p1 {q(fin, 0.01):.2e}"
                  f" median {q(fin, 0.5):.2e} exact ties {int((fin == 0).sum())} rows<1e-3 {int((fin < 1e-3).sum())}")
            sel = [cap64[k] for k in cap64 if k.endswith("index_topk")]
            print(f"  index selection: max selected per row {max(int((s >= 0).sum(-1).max()) for s in sel)}"
                  f" of index_topk {cfg.index_topk}")
        print(f"  greedy gap / logit rms: min {gap.min():.2e} p1 {q(gap, 0.01):.2e} median {q(gap, 0.5):.2e}")
        scales = []
        for L in range(cfg.num_hidden_layers):
            a = cap64[f"L{L}.attn_out"].norm(dim=-1) / cap64[f"L{L}.attn_in"].norm(dim=-1)
            mm = cap64[f"L{L}.mlp_out"].norm(dim=-1) / cap64[f"L{L}.mlp_in"].norm(dim=-1)
            scales.append(f"L{L} {q(a, 0.5):.2f}/{q(mm, 0.5):.2f}")
        print("  |out|/|in| attn/mlp: " + ", ".join(scales))
        div = []
        for L in range(cfg.num_hidden_layers):
            k = f"L{L}.router_ids"
            if k in cap64:
                ids = cap64[k].sort(-1).values
                div.append(f"L{L} {int(ids.unique().numel())}e/{int(ids.unique(dim=0).shape[0])}s")
        print("  experts used / distinct sets: " + ", ".join(div))
        summary.append((name, f32, worst_ulp, float(rm.min()), rdiff, idiff))
    print("== summary: case, fp32 logits rel / worst row / greedy, worst 1-ulp rel / worst row / greedy, "
          "min router margin, router/indexer rows differing (fp32)")
    for name, f32, u, rmin, rd, idf in summary:
        print(f"  {name:15s} fp32 {f32[0]:.2e} {f32[1]:.2e} {f32[2]}  ulp {u[0]:.2e} {u[1]:.2e} {u[2]}"
              f"  router min margin {rmin:.2e}  differing {rd}/{idf}")


if __name__ == "__main__":
    main()
