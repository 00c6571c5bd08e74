"""Train k3-tiny on one GPU: DSA warm-up (dense attention + indexer KL), then sparse top-k training, MXFP4 QAT.

    python3 -m k3train.train --out OUT [--resume DIR] [--total-seconds S] [--time-budget S] [--eval]

The schedule runs on training time (the device gives minutes, not steps): progress = seconds trained over all
calls / --total-seconds.  Recipe (DeepSeek-V3.2, scaled down): the first --dense-frac of it runs dense causal MLA while each layer's indexer
learns the heads-averaged attention distribution by KL (its inputs detached); later steps attend only to the
indexer's top-k keys (index_topk 256 < 2048-token rows) and the indexer's KL is taken over that set.  Routed
experts use MXFP4 fake quantisation with a straight-through gradient throughout.  Router balance is
aux-loss-free (V3): after each step every expert's selection bias moves by ±bias_rate toward equal load.

Checkpoint (the device keeps nothing; files return through $OUT, ≤ 8 files of ≤ 16 MiB): OUT/resume/ holds
the master weights as BF16 safetensors shards of ≤ 15 MiB (master-NN), the router biases, and the
training state (step, data seed, config, loss log) as JSON in master-00's metadata.  Adam moments are NOT saved (they would double or triple the size): on resume they restart
from zero and the learning rate re-warms over 50 steps — documented in train/README.md.  OUT/model/ is the
export in the released layout.

Long-context stage (train/README.md): --init-from an exported model, --long-frac rows opened by one long passkey,
--kl-target dense (the indexer learns the attention over every key, not only the ones it already selects),
--train-only, --micro-batch (halved automatically when a step runs out of GPU memory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from k3data import chat, samples

from .export import build_config, export, tokenizer_dir
from .model import FP32_TENSORS, K3Model

SHARD = 15 * 1024 * 1024


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, seq_len, start_seed, batch, mix_len=None, long=None, forget=None):
        self.seq_len, self.start_seed, self.batch = seq_len, start_seed, batch
        self.mix_len, self.long, self.forget = mix_len, long, forget

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        tok = chat.Tokenizer(tokenizer_dir())
        g = samples.rows(tok, self.seq_len, self.start_seed + wid, stride=nw, mix_len=self.mix_len, long=self.long,
                         forget=self.forget)
        while True:
            ids, ws, seeds, fs = [], [], [], []
            for _ in range(self.batch):
                i, w, s, *f = next(g)
                ids.append(i)
                ws.append(w)
                seeds.append(s)
                fs += f
            out = (torch.from_numpy(np.stack(ids)).long(), torch.from_numpy(np.stack(ws)), max(seeds))
            # with forget: the rows' forget windows too ([B, T] bool); other users unpack three
            yield out + (torch.from_numpy(np.stack(fs)),) if self.forget is not None else out


def save_resume(model, path, meta):
    os.makedirs(path, exist_ok=True)
    # BF16 master weights, except the tensors the release keeps in FP32 (tiny; rounding them would change the
    # exported model)
    tensors = {n: p.detach().to(torch.float32 if n.endswith(FP32_TENSORS) else torch.bfloat16).cpu().contiguous()
               for n, p in model.named_master()}
    for L in range(model.cfg.num_hidden_layers):
        if model.cfg.is_moe(L):
            tensors[f"router_bias.{L}"] = model.router_bias(L).detach().float().cpu().contiguous()
    shards, cur, size = [], {}, 0
    for n in sorted(tensors):
        nb = tensors[n].numel() * tensors[n].element_size()
        if cur and size + nb > SHARD:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = tensors[n]
        size += nb
    shards.append(cur)
    for f in os.listdir(path):
        if f.startswith("master-"):
            os.remove(os.path.join(path, f))
    for i, part in enumerate(shards):
        # the training state rides in the first shard's metadata: one file fewer to bring back
        md = {"k3train_state": json.dumps(meta)} if i == 0 else {}
        save_file(part, os.path.join(path, f"master-{i:02d}.safetensors"), metadata=md)


def load_resume(model, path):
    from safetensors import safe_open
    with safe_open(os.path.join(path, "master-00.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["k3train_state"])
    sd = {}
    for fn in sorted(os.listdir(path)):
        if fn.startswith("master-"):
            sd.update(load_file(os.path.join(path, fn)))
    with torch.no_grad():
        for n, p in model.named_master():
            p.copy_(sd[n].float())
        for L in range(model.cfg.num_hidden_layers):
            if model.cfg.is_moe(L):
                model.router_bias(L).copy_(sd[f"router_bias.{L}"])
    return meta


TRAIN_ONLY = ("all", "attn", "indexer")


def trainable(name, cfg, only):
    """--train-only: "indexer" = the DSA indexers; "attn" = everything in the MLA layers' self_attn (the
    indexer included) — the parts that decide what a long context's query can see."""
    if only == "all":
        return True
    if only == "indexer":
        return ".indexer." in name
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and parts[3] == "self_attn" and cfg.is_mla(int(parts[2]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--total-seconds", type=float, default=540,
                    help="planned training time over all calls: the schedule (warm-up phase, LR) runs on it")
    ap.add_argument("--dense-frac", type=float, default=0.12, help="fraction of the schedule in dense warm-up")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds of training in this call")
    ap.add_argument("--max-steps", type=int, default=10 ** 9)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="rows per forward/backward (gradient summed over the batch; default all; halved on OOM)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", action="store_true", help="run the evaluation after training")
    ap.add_argument("--eval-args", default="", help="extra args for k3train.evaluate (space separated)")
    # long-context stage (train/README.md): continue an exported model on longer rows
    ap.add_argument("--init-from", default=None, help="exported model dir (released layout) to start from")
    ap.add_argument("--long-frac", type=float, default=0.0, help="fraction of rows opened by one long passkey")
    ap.add_argument("--long-min", type=int, default=4096, help="shortest long passkey (tokens)")
    ap.add_argument("--long-max", type=int, default=None, help="longest long passkey (tokens; default --seq - 1)")
    ap.add_argument("--long-shallow", type=float, default=0.0,
                    help="fraction of the long passkeys with the key in the first tenth of the filler (farthest from "
                         "the question; the rest at a uniform depth)")
    ap.add_argument("--kda-forget", type=float, default=0.0,
                    help="fraction of the long passkeys with a forget window between the needle and the question: "
                         "every KDA layer's decay at its floor there, so the key must come back through the MLA "
                         "layers, whose NoPE retrieval does not weaken with distance (README)")
    ap.add_argument("--forget-width", type=int, default=4, help="tokens in a forget window (e^-5 each)")
    ap.add_argument("--kda-memory", type=int, default=0,
                    help="N > 0: cap the KDA states' memory at ~N tokens — each channel whose gate keeps 5 %% of "
                         "the tokens longer than N is mapped once at the start (calibrate_kda_memory), and a hinge "
                         "on every token's log-decay below 1/N joins the loss — so the states a 32K row ends with "
                         "are the states of a 1M-token prompt (README)")
    ap.add_argument("--kda-memory-weight", type=float, default=1.0, help="weight of the --kda-memory hinge")
    ap.add_argument("--mix-len", type=int, default=None,
                    help="the mix's passkey prompts stay under this (default --seq; 2048 keeps the original mix)")
    ap.add_argument("--kl-target", choices=("selected", "dense"), default="selected",
                    help="sparse phase: the indexer's KL over its selected keys (V3.2) or over every causal key")
    ap.add_argument("--q-chunk", type=int, default=0,
                    help="MLA query rows per checkpointed chunk (0: all at once): the indexer's, the selection's and "
                         "the KL's [rows, T, S] tensors become [rows, chunk, S], for rows past 16K (README)")
    ap.add_argument("--recompute", action="store_true",
                    help="recompute the KDA and MLP sublayers in the backward pass (their O(T) intermediates, "
                         "~2 MB a token, are not kept): with --q-chunk, rows of 64K tokens and more (README)")
    ap.add_argument("--train-only", choices=TRAIN_ONLY, default="all",
                    help="freeze all but the DSA indexers (indexer) or the MLA layers' attention (attn)")
    args = ap.parse_args(argv)
    if args.resume and args.init_from:
        ap.error("--resume and --init-from exclude each other")
    if args.q_chunk < 0:
        ap.error("--q-chunk must be ≥ 0")
    if not 0.0 <= args.long_shallow <= 1.0:
        ap.error("--long-shallow must be in [0, 1]")
    if not 0.0 <= args.kda_forget <= 1.0 or args.forget_width < 1:
        ap.error("--kda-forget must be in [0, 1] and --forget-width ≥ 1")
    if args.kda_memory < 0 or args.kda_memory_weight < 0:
        ap.error("--kda-memory and --kda-memory-weight must be ≥ 0")
    if args.kda_forget > 0 and args.long_frac <= 0:
        ap.error("--kda-forget needs long passkey rows (--long-frac > 0)")
    if args.long_max is None:
        args.long_max = args.seq - 1
    if args.long_frac > 0 and not 0 < args.long_min <= args.long_max < args.seq:
        ap.error(f"need 0 < --long-min <= --long-max < --seq ({args.long_min}, {args.long_max}, {args.seq})")
    return args


def main(argv=None):
    args = parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.init_from:
        # the init's own config.json is exported again (its max_position_embeddings, not the builder's)
        from .evaluate import load_exported
        with open(os.path.join(args.init_from, "config.json")) as f:
            config = json.load(f)
        model = load_exported(args.init_from, dev)
        print(f"initialised from {args.init_from}", flush=True)
    else:
        config = build_config(args.config)
        model = K3Model(config["text_config"], seed=args.seed).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}", flush=True)
    step, start_seed, log, rewarm_from, before = 0, args.seed * 1000, [], None, 0.0
    if args.resume:
        meta = load_resume(model, args.resume)
        step, start_seed, log = meta["step"], meta["next_seed"], meta.get("log", [])
        before = meta.get("train_seconds", 0.0)
        rewarm_from = step
        print(f"resumed at step {step}, data seed {start_seed}", flush=True)

    model.kl_dense = args.kl_target == "dense"
    model.q_chunk = args.q_chunk
    model.recompute = args.recompute
    model.kda_memory = args.kda_memory

    def keep(n):
        return trainable(n, model.cfg, args.train_only)

    decay, no_decay = [], []
    for n, p in model.named_master():
        p.requires_grad_(keep(n))
        if not keep(n):
            continue
        (decay if p.dim() >= 2 and "res_proj" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")

    def lr_at(s, prog):
        lr = args.lr * min(1.0, (s + 1) / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
        if rewarm_from is not None:
            lr *= min(1.0, (s - rewarm_from + 1) / 50)
        return lr

    print(f"trainable {sum(p.numel() for p in decay + no_decay):,} ({args.train_only})", flush=True)
    long = (args.long_frac, args.long_min, args.long_max, args.long_shallow) if args.long_frac > 0 else None
    forget = (args.kda_forget, args.forget_width) if args.kda_forget > 0 else None
    loader = torch.utils.data.DataLoader(Rows(args.seq, start_seed, args.batch, args.mix_len, long, forget),
                                         batch_size=None,
                                         num_workers=args.workers, prefetch_factor=4 if args.workers else None,
                                         persistent_workers=False)
    it = iter(loader)
    t_start = time.time()
    next_seed = start_seed
    first = step
    try:
        step, next_seed = _loop(args, model, opt, it, dev, lr_at, log, step, first, next_seed, before, t_start)
    finally:   # whatever happens, keep what was trained
        meta = {"step": step, "next_seed": next_seed, "train_seconds": before + time.time() - t_start,
                "log": log, "config": args.config, "params": n_params, "args": vars(args)}
        save_resume(model, os.path.join(args.out, "resume"), meta)
    total = export(model, os.path.join(args.out, "model"), config)
    print(f"saved step {step}; exported {total:,} bytes", flush=True)
    del it, loader   # stop the data workers: they would compete with evaluation for the CPU
    if args.eval:
        from . import evaluate
        evaluate.main(["--model-dir", os.path.join(args.out, "model"), "--out", os.path.join(args.out, "scores.json"),
                       *args.eval_args.split()], model=model)


def _forward_backward(args, model, ids, w, mode, forget=None):
    """Loss and gradient of one step, in pieces of --micro-batch rows (default: all at once); each piece's
    losses are normalised by the whole batch's weights, so the summed gradient is the whole batch's.
    forget (optional) [B, T] bool: the rows' KDA forget windows (--kda-forget)."""
    dev = ids.device
    wt_all = w[:, 1:]
    n_w, n_t = wt_all.sum(), (wt_all == 1.0).sum().clamp_min(1)
    mb = args.micro_batch or ids.shape[0]
    pieces = range(0, ids.shape[0], mb)
    lm_s, tgt_s, kl_s, mem_s, load = 0.0, 0.0, 0.0, 0.0, {}
    for a in pieces:
        kl, ld, mem = [], {}, []
        fg = forget[a:a + mb, :-1] if forget is not None else None
        h = model.hidden(ids[a:a + mb, :-1], mode=mode, kl_out=kl, load_out=ld,
                         forget=fg if fg is not None and bool(fg.any()) else None, mem_out=mem)
        logits = model.logits(h)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[a:a + mb, 1:].reshape(-1), reduction="none")
        wt = w[a:a + mb, 1:].reshape(-1)
        lm = (nll * wt).sum() / n_w
        tgt = (nll * (wt == 1.0)).sum().detach() / n_t
        klv = (torch.stack(kl).mean() if kl else torch.zeros((), device=dev)) / len(pieces)
        memv = (torch.stack(mem).mean() if mem else torch.zeros((), device=dev)) / len(pieces)
        (lm + args.kl_weight * klv + args.kda_memory_weight * memv).backward()
        lm_s, tgt_s, kl_s, mem_s = lm_s + lm.detach(), tgt_s + tgt, kl_s + klv.detach(), mem_s + memv.detach()
        for L, c in ld.items():
            load[L] = load[L] + c if L in load else c
    return lm_s, tgt_s, kl_s, mem_s, load


def calibrate_kda_memory(model, ids, n_mem, lo_q=0.05, hi_q=0.95, span=4.0):
    """--kda-memory's one-time start, on the gate logits u = exp(A_log)·z of `ids` [B, T] (per token and channel):
    k3-tiny's KDA keeps most channels for 10^5..10^30 tokens on most tokens (its u spans tens of units below the
    floor), which Adam's ~lr-sized steps could not undo in a short stage. Each channel whose lo_q quantile of u
    lies below the floor u_f (−g = 5·σ(u_f) = 1/n_mem) gets the affine map u ↦ s·u + t that sends that quantile to
    u_f + 0.5 and its hi_q quantile to max(its own value, u_f + 0.5 + span) (s ≤ 1): f_b_proj's row scaled by s
    and dt_bias set to s·dt_bias + t/exp(A_log). The tokens keep their order (which ones forget, which keep), only
    the tail that would keep a state for ever is pulled to ~n_mem tokens; the hinge then holds the rest.
    Returns {layer: channels changed}."""
    cfg = model.cfg
    H, Dk = cfg.kda_num_heads, cfg.kda_head_dim
    p = 1.0 / (n_mem * -cfg.gate_lower_bound)
    u_f = math.log(p / (1.0 - p))
    was, model.kda_memory, model.u_stats = model.kda_memory, 0, {}
    try:
        with torch.no_grad():
            model.hidden(ids)
        stats = model.u_stats
    finally:
        model.kda_memory, model.u_stats = was, None
    changed = {}
    with torch.no_grad():
        for L, u in sorted(stats.items()):                          # u FP32 [tokens, H, Dk]
            A = f"model.layers.{L}.self_attn."
            q = torch.quantile(u.reshape(u.shape[0], -1).double(), torch.tensor([lo_q, hi_q], dtype=torch.double,
                               device=u.device), dim=0)              # [2, H·Dk]
            lo, hi = q[0], q[1]
            lo_t = torch.full_like(lo, u_f + 0.5)
            hi_t = torch.maximum(hi, lo_t + span)
            s = ((hi_t - lo_t) / (hi - lo).clamp_min(1e-6)).clamp(max=1.0)
            t = lo_t - s * lo
            fix = lo < u_f
            s, t = torch.where(fix, s, torch.ones_like(s)), torch.where(fix, t, torch.zeros_like(t))
            a = torch.exp(model.p(A + "A_log")[:H]).double().repeat_interleave(Dk)   # [H·Dk]
            wb, db = model.p(A + "f_b_proj.weight"), model.p(A + "dt_bias")
            wb.mul_(s.to(wb.dtype).unsqueeze(1))
            db.copy_((s * db.double() + t / a).to(db.dtype))
            changed[L] = int(fix.sum())
    return changed


def _loop(args, model, opt, it, dev, lr_at, log, step, first, next_seed, before, t_start):
    t_log, tok_log = time.time(), 0
    while step - first < args.max_steps and time.time() - t_start < args.time_budget:
        prog = (before + time.time() - t_start) / args.total_seconds
        ids, w, ns, *fg = next(it)
        next_seed = max(next_seed, int(ns))
        ids, w = ids.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
        fg = fg[0].to(dev, non_blocking=True) if fg else None
        if args.kda_memory and step == first:   # the first batch's first row calibrates the gates (once a run)
            mapped = calibrate_kda_memory(model, ids[:1, :8192], args.kda_memory)
            print(json.dumps({"kda_memory": args.kda_memory, "channels_mapped": mapped}), flush=True)
        mode = "dense" if prog < args.dense_frac else "sparse"
        lr = lr_at(step, prog)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        opt.zero_grad(set_to_none=True)
        while True:
            try:
                lm, tgt, klv, memv, load = _forward_backward(args, model, ids, w, mode, fg)
                break
            except torch.cuda.OutOfMemoryError:
                if (args.micro_batch or args.batch) == 1:
                    raise
            # long rows: rather than lose the call, run the step in smaller pieces (same gradient); out of the
            # except block, so the failed attempt's tensors are gone with its traceback
            args.micro_batch = (args.micro_batch or args.batch) // 2
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"out of memory: --micro-batch {args.micro_batch} from step {step} on", flush=True)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for L, cnt in (load.items() if args.train_only == "all" else ()):   # frozen experts keep their bias
                cnt = cnt.float()
                model.router_bias(L).add_(args.bias_rate * torch.sign(cnt.mean() - cnt))
        step += 1
        tok_log += ids.numel()
        if step % args.log_every == 0:
            torch.cuda.synchronize() if dev.type == "cuda" else None
            dt = time.time() - t_log
            rec = {"step": step, "mode": mode, "loss": round(lm.item(), 4), "target_loss": round(tgt.item(), 4),
                   "kl": round(klv.item(), 4), **({"mem": round(memv.item(), 5)} if args.kda_memory else {}),
                   "gnorm": round(gn.item(), 3), "lr": lr,
                   "tok_per_s": round(tok_log / dt), "elapsed_s": round(time.time() - t_start, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
            t_log, tok_log = time.time(), 0
    return step, next_seed


if __name__ == "__main__":
    main()
