"""Train the DSpark draft of k3-tiny on one GPU from k3-tiny's own hidden states on its training data (#19).

    cd train && python3 -m k3train.train_dspark --target ../models/k3-tiny --out OUT [--time-budget 240]

Every step: a batch of k3-tiny's training rows (k3data.samples.rows, the same generator and seeds the target
was trained on, 2,048-token packed rows) runs through the frozen target (K3Model loaded from the released
checkpoint, sparse DSA attention as served), which yields the AttnRes taps after the draft's
`target_layer_ids` and its logits.  `--anchors` draft blocks per row are drawn (anchors mostly on generated =
assistant tokens, the only place a served draft ever drafts), and the draft (context projection, draft layers,
final norm, Markov head; the target's embedding and lm_head frozen) is trained teacher forced, exactly the
forward of reference/k3ref/dspark.py (k3train/dspark.py).

Loss: block position i of the block at p predicts x_{p+1+i}; its label is the target's own next-token
distribution at p+i (soft cross-entropy = KL to the target up to a constant; `--labels data` uses the data
token instead), weighted by `--decay`^i (the first positions decide the acceptance length) and by 1 on
assistant tokens / `--context-weight` elsewhere, 0 past the row.  AdamW, warm-up, cosine on training time.

Measured on held-out conversations (seeds ≥ 3,000,000) per task at the end: the teacher-forced greedy
acceptance estimate 1 + Σ_i Π_{j≤i} [argmax draft_j = argmax target_j] over anchors on assistant tokens, and the
per-position agreement.  The real acceptance comes from the engine (k3data/spec_eval.py) on the CPU.

Output (≤ 8 files of ≤ 16 MiB, the device tool's limits): OUT/k3-tiny-dspark/{config.json, model.safetensors}
and OUT/train_dspark.json (arguments, sizes, loss log, held-out estimate; k3data/spec_eval.py card reads it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import time

import numpy as np
import torch

from k3data import chat, samples

from .dspark import DSparkDraft, draft_config, export
from .evaluate import load_exported
from .train import Rows

HELD_OUT_SEED = 3_000_000
TASKS = ("passkey", "tool", "arith", "chat")


def target_pass(target, ids, layers, mode):
    """Frozen target over ids [B, T]: taps [B, T, n·D] (BF16 values) and logits [B, T, V] (FP32)."""
    with torch.no_grad():
        taps = {L: None for L in layers}
        h = target.hidden(ids, mode=mode, taps=taps)
        return torch.cat([taps[L] for L in layers], dim=-1), target.logits(h)


def draw_anchors(w, ids, nb, pad, other, gen):
    """Anchors [B, nb]: positions p whose token and next token are generated (weight 1: the assistant), plus
    with relative weight `other` any other non-padding position; without replacement."""
    B, T = ids.shape
    live = (ids != pad)
    asst = torch.zeros_like(live)
    asst[:, :-1] = (w[:, :-1] == 1.0) & (w[:, 1:] == 1.0)
    prob = asst.float() + other * (live & ~asst).float()
    prob = prob + 1e-9          # enough categories for nb draws in any row (padding anchors get zero weight)
    prob[:, -1] = 0.0
    n = min(nb, T - 1)
    return torch.multinomial(prob, n, replacement=False, generator=gen)


def label_weights(w, ids, anchors, N, pad, decay, context_weight):
    """[B, nb, N]: decay^i × (1 on assistant targets, context_weight elsewhere), 0 past the row / on padding."""
    B, T = ids.shape
    tpos = anchors.unsqueeze(-1) + 1 + torch.arange(N, device=ids.device)        # target positions
    inside = tpos < T
    tp = tpos.clamp(max=T - 1).view(B, -1)
    wt = torch.gather(w, 1, tp).view_as(tpos)
    it = torch.gather(ids, 1, tp).view_as(tpos)
    lw = torch.where(wt == 1.0, torch.ones_like(wt), torch.full_like(wt, context_weight))
    lw = lw * (decay ** torch.arange(N, device=ids.device, dtype=torch.float32))
    return lw * (inside & (it != pad)).float()


def gather_rows(x, anchors, N, T):
    """x [B, T, ...] at positions anchor+i (clamped), i < N -> [B, nb, N, ...]."""
    B = x.shape[0]
    pos = (anchors.unsqueeze(-1) + torch.arange(N, device=x.device)).clamp(max=T - 1).view(B, -1)
    idx = pos.view(B, -1, *([1] * (x.dim() - 2))).expand(B, pos.shape[1], *x.shape[2:])
    return torch.gather(x, 1, idx).view(B, anchors.shape[1], N, *x.shape[2:])


def block_loss(draft, target, ids, w, anchors, tlogits, taps, args, pad):
    N = draft.cfg.block_size
    B, T = ids.shape
    embed = target.w("model.embed_tokens.weight")
    lm_head = target.w("lm_head.weight")
    logits = draft(embed, lm_head, taps, ids, anchors)                               # [B, nb, N, V]
    lw = label_weights(w, ids, anchors, N, pad, args.decay, args.context_weight)
    logp = torch.log_softmax(logits, dim=-1)
    tl = gather_rows(tlogits, anchors, N, T)                                          # target at p+i
    if args.labels == "target":
        ce = -(torch.softmax(tl, dim=-1) * logp).sum(-1)
    else:
        tpos = (anchors.unsqueeze(-1) + 1 + torch.arange(N, device=ids.device)).clamp(max=T - 1)
        ce = -torch.gather(logp, -1, torch.gather(ids, 1, tpos.view(B, -1)).view(B, -1, N, 1)).squeeze(-1)
    loss = (ce * lw).sum() / lw.sum().clamp_min(1e-6)
    with torch.no_grad():
        match = (logits.argmax(-1) == tl.argmax(-1)) & (lw > 0)
    return loss, match, lw > 0


def acceptance_estimate(match, valid):
    """match/valid [..., N] -> (mean 1 + leading matches, per-position agreement)."""
    m = (match & valid).float()
    lead = torch.cumprod(m, dim=-1).sum(-1)
    agree = m.sum(tuple(range(m.dim() - 1))) / valid.float().sum(tuple(range(m.dim() - 1))).clamp_min(1)
    return float((1 + lead).mean()), [round(float(a), 4) for a in agree]


def held_out_rows(tok, task, n, seq):
    """n single-conversation rows of one task (seeds ≥ HELD_OUT_SEED, never trained on), right-padded."""
    pad = tok.special("[PAD]")
    ids = np.full((n, seq), pad, dtype=np.int32)
    ws = np.zeros((n, seq), dtype=np.float32)
    seed, k = HELD_OUT_SEED, 0
    while k < n:
        r = random.Random(seed)
        from k3data import gen
        if task == "passkey":
            conv = gen.passkey(seed, context_tokens=r.randint(128, max(128, seq - 200)))
        else:
            conv = gen.GENERATORS[task](seed)
        seed += 1
        i, wt = samples.encode_sample(tok, conv)
        i, wt = i[:seq], wt[:seq]
        ids[k, :len(i)] = i
        ws[k, :len(wt)] = wt
        k += 1
    return torch.from_numpy(ids).long(), torch.from_numpy(ws)


def evaluate(draft, target, tok, args, dev, pad):
    out = {}
    draft.eval()
    g = torch.Generator(device=dev).manual_seed(1234)
    for task in TASKS:
        ids, w = held_out_rows(tok, task, args.eval_rows, args.seq)
        ids, w = ids.to(dev), w.to(dev)
        with torch.no_grad():
            taps, tl = target_pass(target, ids, draft.cfg.target_layer_ids, "sparse")
            anchors = draw_anchors(w, ids, args.anchors, pad, 1e-6, g)
            _, match, valid = block_loss(draft, target, ids, w, anchors, tl, taps, args, pad)
            # only anchors on generated tokens (short rows fall back to others)
            asst = torch.gather(((w[:, :-1] == 1.0) & (w[:, 1:] == 1.0)).float(), 1, anchors.clamp(max=w.shape[1] - 2)) > 0
            est, agree = acceptance_estimate(match[asst], valid[asst])
        n = int(asst.sum())
        out[task] = {"blocks": n, "acceptance_estimate": round(est, 3) if n else None, "agreement_by_position": agree}
        print(json.dumps({"held_out": task, **out[task]}), flush=True)
    draft.train()
    return out


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(here, "..", "..", "models", "k3-tiny"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="k3-tiny-dspark", help="subdirectory of --out for the draft")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=JSON", help="draft config field")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds of training")
    ap.add_argument("--max-steps", type=int, default=10 ** 9)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=64, help="draft blocks per row")
    ap.add_argument("--reuse", type=int, default=2, help="draft steps per target batch (fresh anchors each)")
    ap.add_argument("--other-weight", type=float, default=0.05,
                    help="relative chance of an anchor on a non-generated token")
    ap.add_argument("--labels", choices=("target", "data"), default="target")
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight decay over block positions")
    ap.add_argument("--context-weight", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="target attention")
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out rows per task (0: none)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    target = load_exported(args.target, dev)
    target.requires_grad_(False)
    target.freeze_quant()
    tok = chat.Tokenizer(args.target)
    pad = tok.special("[PAD]")
    over = {}
    for kv in args.override:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v)
    cfg = draft_config(over)
    if cfg["vocab_size"] != target.cfg.vocab_size or cfg["hidden_size"] != target.cfg.hidden_size:
        raise SystemExit("draft vocab/hidden must equal the target's")
    draft = DSparkDraft(cfg, seed=args.seed).to(dev)
    n_params = sum(p.numel() for p in draft.parameters())
    print(f"draft params {n_params:,}; target loaded in {time.time() - t0:.1f} s", flush=True)

    decay, no_decay = [], []
    for n, p in draft.named_master():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    loader = torch.utils.data.DataLoader(Rows(args.seq, args.seed * 1000, args.batch), batch_size=None,
                                         num_workers=args.workers, prefetch_factor=4 if args.workers else None)
    it = iter(loader)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    log = []
    error = None

    def _term(signum, frame):       # `timeout` / the device's limit: stop training, still export
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    try:
        step, rows = _loop(args, draft, target, opt, it, gen, dev, pad, log)
    except (Exception, KeyboardInterrupt) as e:   # keep what was trained: the device call is not repeated lightly
        import traceback
        traceback.print_exc()
        error = repr(e)
        step, rows = _loop.progress
    train_s = time.time() - _loop.t_start
    del it, loader
    out_dir = os.path.join(args.out, args.name)
    nbytes = export(draft, out_dir)
    print(f"trained {step} steps ({rows} rows, {rows * args.seq:,} tokens) in {train_s:.0f} s; "
          f"exported {nbytes:,} bytes to {out_dir}", flush=True)
    held = {}
    if args.eval_rows > 0 and error is None:
        try:
            held = evaluate(draft, target, tok, args, dev, pad)
        except Exception as e:
            import traceback
            traceback.print_exc()
            held = {"error": repr(e)}
    summary = {"args": vars(args), "draft_params": n_params, "draft_bytes": nbytes, "steps": step, "rows": rows,
               "tokens": rows * args.seq, "train_seconds": round(train_s, 1),
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "held_out": held, "log": log, "config": cfg, "error": error}
    with open(os.path.join(args.out, "train_dspark.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if error:
        raise SystemExit(f"training stopped early: {error} (the draft trained so far is exported)")


def _loop(args, draft, target, opt, it, gen, dev, pad, log):
    """The training loop; `_loop.progress` holds (steps, rows) so far, for the export after an error."""
    step, rows = 0, 0
    _loop.progress, _loop.t_start = (0, 0), time.time()
    t_start = _loop.t_start
    t_log, m_sum, v_sum, l_sum, n_sum = time.time(), None, None, 0.0, 0
    while step < args.max_steps and time.time() - t_start < args.time_budget:
        ids, w, _ = next(it)
        ids, w = ids.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
        taps, tl = target_pass(target, ids, draft.cfg.target_layer_ids, args.mode)
        rows += ids.shape[0]
        for _ in range(args.reuse):
            prog = (time.time() - t_start) / args.time_budget
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
            for gp in opt.param_groups:
                gp["lr"] = lr
            anchors = draw_anchors(w, ids, args.anchors, pad, args.other_weight, gen)
            loss, match, valid = block_loss(draft, target, ids, w, anchors, tl, taps, args, pad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
            _loop.progress = (step, rows)
            mm = (match & valid).flatten(0, 1).sum(0).float()
            vv = valid.flatten(0, 1).sum(0).float()
            m_sum = mm if m_sum is None else m_sum + mm
            v_sum = vv if v_sum is None else v_sum + vv
            l_sum += loss.item()
            n_sum += 1
            if step % args.log_every == 0:
                rec = {"step": step, "rows": rows, "loss": round(l_sum / n_sum, 4), "gnorm": round(float(gn), 3),
                       "lr": round(lr, 6), "agreement_by_position": [round(float(x), 3) for x in m_sum / v_sum.clamp_min(1)],
                       "elapsed_s": round(time.time() - t_start, 1),
                       "steps_per_s": round(n_sum / (time.time() - t_log), 2)}
                log.append(rec)
                print(json.dumps(rec), flush=True)
                t_log, m_sum, v_sum, l_sum, n_sum = time.time(), None, None, 0.0, 0
    return step, rows


if __name__ == "__main__":
    main()
