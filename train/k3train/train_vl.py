"""Train the vision tower + projector of k3-tiny-vl on procedural images, the text model frozen (issue #21 pt 5).

    python3 -m k3train.train_vl --text-model ../models/k3-tiny --out OUT [--time-budget 300] [--batch 256]
        [--eval-set ../models/k3-tiny-vl/eval/image.jsonl] [--resume OUT_PREV/vision.safetensors]

The text model is loaded from the released checkpoint (evaluate.load_exported) and frozen: no parameter of it
gets a gradient, so the exported text tensors are byte-identical copies of k3-tiny's and its text scores are
unchanged by construction.  Only the MoonViT-V2-structured tower (vision.py, VISION_TINY) and the
patchmergerv2 projector are trained, by back-propagation through the frozen language model: loss = cross-
entropy on the assistant turn's tokens (what the model generates) of single-image conversations
(k3data/vision_gen.py, 5 tasks in turn, or weighted by --task-weights), the <|media_pad|> positions' embeddings replaced by the projector's
rows (K3Model.hidden media=).  One conversation per row, right-padded (causal: padding changes nothing before
it); rows are < index_topk (256) tokens, so dense attention is exactly what the engine's top-k attention does.

Schedule on training time, as train.py: AdamW β 0.9/0.95, wd 0.05 on matrices, warm-up --warmup steps, cosine to
10 % of --lr over --total-seconds (default: --time-budget; a --resume call then restarts warm-up and cosine).  post_norm starts at the text embeddings' RMS so the
image rows start at the scale of the token embeddings.

Evaluation (--eval-set, the committed eval set): teacher-forced exact match — an item is right when the argmax at
every assistant-turn position is the target token, which is exactly when greedy decoding reproduces the answer
turn.  A few items per task every --eval-every seconds (logged), the whole set at the end (per task, in
OUT/train_log.json).

--train-text (NOT the default; a fallback should the frozen model miss 90 % on some task): the text model is
trained too, at --text-lr, with replay of k3-tiny's own training data (k3data.samples rows of 2,048 tokens,
--text-batch per step, sparse top-k attention as train.py's sparse phase, router biases fixed) so its text
skills are kept; its master weights go to OUT/resume/ as train.py writes them (3 files) and its text scores
must then be measured again (models/k3-tiny/README.md's commands).

Output (≤ 8 files ≤ 16 MiB): OUT/vision.safetensors (the tower + projector, BF16, the released names; the
training state as JSON in its metadata; `--resume` restarts from it with fresh Adam moments) and
OUT/train_log.json.  `python3 -m k3train.export_vl` assembles models/k3-tiny-vl from it and models/k3-tiny.
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

from k3data import chat, images, vision_gen

from .evaluate import load_exported
from .export import tokenizer_dir
from .vision import VisionTower, patchify, vision_config

SEQ = vision_gen.MAX_TOKENS     # tokens per row


def task_cycle(spec):
    """--task-weights "digits=3,word=3" -> the task of sample seed s is cycle[s % len(cycle)]: each task repeated
    by its integer weight (default 1), in vision_gen.TASKS order, so the stream stays a pure function of the seed."""
    w = {t: 1 for t in vision_gen.TASKS}
    for part in filter(None, (spec or "").split(",")):
        name, _, n = part.partition("=")
        if name.strip() not in w or not n.strip().isdigit():
            raise SystemExit(f"--task-weights: bad entry {part!r} (tasks: {', '.join(vision_gen.TASKS)}; integer weights)")
        w[name.strip()] = int(n)
    cycle = tuple(t for t in vision_gen.TASKS for _ in range(w[t]))
    if not cycle:
        raise SystemExit("--task-weights: every weight is 0")
    return cycle


class Batches(torch.utils.data.IterableDataset):
    def __init__(self, batch, start_seed, pad_id, cycle=vision_gen.TASKS):
        self.batch, self.start_seed, self.pad_id, self.cycle = batch, start_seed, pad_id, cycle

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        tok = chat.Tokenizer(tokenizer_dir())
        seed = self.start_seed + wid
        while True:
            imgs = np.empty((self.batch, vision_gen.SIZE, vision_gen.SIZE, 3), dtype=np.uint8)
            ids = np.full((self.batch, SEQ), self.pad_id, dtype=np.int64)
            w = np.zeros((self.batch, SEQ), dtype=np.float32)
            for b in range(self.batch):
                s = seed % 1_000_000
                conv = vision_gen.conversation(s, self.cycle[s % len(self.cycle)])
                seed += nw
                i, m = vision_gen.encode_sample(tok, conv)
                if len(i) > SEQ:
                    raise ValueError(f"conversation of {len(i)} tokens > {SEQ}")
                imgs[b] = conv["image"]
                ids[b, :len(i)] = i
                w[b, :len(m)] = m
            yield torch.from_numpy(imgs), torch.from_numpy(ids), torch.from_numpy(w), seed


def eval_batches(path, tok, pad_id, per_task=None):
    """The eval set as teacher-forcing batches per task: (task, imgs uint8, ids, target mask, item ids)."""
    by_task = {}
    with open(path) as f:
        for line in f:
            it = json.loads(line)
            kind = it["meta"]["kind"]
            if per_task is not None and len(by_task.get(kind, [])) >= per_task:
                continue
            msgs = it["request"]["messages"] + [{"role": "assistant", "reasoning_content": "",
                                                 "content": it["expect"]["answer"]}]
            i, m = chat.encode_training(tok, msgs, images=vision_gen.url_resolver)
            part = it["request"]["messages"][0]["content"][0]
            img = images.decode_png(images.png_from_data_url(part["image_url"]["url"]))
            by_task.setdefault(kind, []).append((img, i, m, it["id"]))
    out = []
    for kind, rows in by_task.items():
        imgs = np.stack([r[0] for r in rows])
        ids = np.full((len(rows), SEQ), pad_id, dtype=np.int64)
        w = np.zeros((len(rows), SEQ), dtype=np.float32)
        for b, (_, i, m, _) in enumerate(rows):
            ids[b, :len(i)] = i
            w[b, :len(m)] = m
        out.append((kind, torch.from_numpy(imgs), torch.from_numpy(ids), torch.from_numpy(w), [r[3] for r in rows]))
    return out


def forward(lm, tower, imgs, ids, media_id, dev):
    """-> logits-ready hidden [B, T-1, D] of ids[:, :-1] with the images' rows at the <|media_pad|> positions."""
    patches = patchify(imgs.to(dev, non_blocking=True))
    g = vision_gen.SIZE // tower.patch
    rows = tower(patches, g, g)                                   # [B, tokens, D]
    x = ids[:, :-1]
    mask = x == media_id
    return lm.hidden(x, mode="dense", media=(mask, rows.reshape(-1, rows.shape[-1])))


@torch.no_grad()
def evaluate(lm, tower, batches, media_id, dev, chunk=128):
    res = {}
    for kind, imgs, ids, w, _ in batches:
        right = 0
        for s in range(0, imgs.shape[0], chunk):
            ii, tt, ww = imgs[s:s + chunk], ids[s:s + chunk].to(dev), w[s:s + chunk].to(dev)
            h = forward(lm, tower, ii, tt, media_id, dev)
            pred = lm.logits(h).argmax(-1)
            tgt = ww[:, 1:] > 0
            ok = ((pred == tt[:, 1:]) | ~tgt).all(-1)
            right += int(ok.sum())
        res[kind] = {"n": int(imgs.shape[0]), "correct": right, "accuracy": right / max(1, imgs.shape[0])}
    return res


def save_vision(tower, path, meta):
    t = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in tower.named_tensors()}
    save_file(t, path, metadata={"k3train_vl_state": json.dumps(meta), "vision_config": json.dumps(tower.vc)})


def load_vision(tower, path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["k3train_vl_state"])
    sd = load_file(path)
    with torch.no_grad():
        for n, p in tower.named_tensors():
            p.copy_(sd[n].float())
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-model", required=True, help="released k3-tiny checkpoint (frozen)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None, help="a vision.safetensors of an earlier call")
    ap.add_argument("--time-budget", type=float, default=300, help="seconds of training in this call")
    ap.add_argument("--total-seconds", type=float, default=None, help="length of one cosine schedule continued across --resume calls (default: each call its own cosine over --time-budget)")
    ap.add_argument("--max-steps", type=int, default=10 ** 9)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-set", default=None)
    ap.add_argument("--eval-every", type=float, default=60, help="seconds between quick evaluations")
    ap.add_argument("--eval-limit", type=int, default=None, help="only the first N items per task (smoke tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-weights", default="",
                    help='samples per task in each cycle, e.g. "digits=3,word=3" (default 1 each: the 5 tasks in turn)')
    ap.add_argument("--vision-override", default="{}", help="JSON merged into the vision config (smoke tests)")
    ap.add_argument("--train-text", action="store_true", help="also train the text model, with text replay")
    ap.add_argument("--text-lr", type=float, default=1e-4)
    ap.add_argument("--text-batch", type=int, default=4, help="replay rows of 2,048 tokens per step")
    args = ap.parse_args(argv)
    total = args.total_seconds or args.time_budget
    os.makedirs(args.out, exist_ok=True)

    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = chat.Tokenizer(tokenizer_dir())
    media_id, pad_id = tok.special("<|media_pad|>"), tok.special("[PAD]")
    lm = load_exported(args.text_model, dev)
    if not args.train_text:
        for p in lm.parameters():
            p.requires_grad_(False)
        lm.freeze_quant()
    D = lm.cfg.hidden_size
    vc = vision_config(D, json.loads(args.vision_override))
    tower = VisionTower(vc, seed=args.seed)
    with torch.no_grad():   # image rows start at the scale of the token embeddings
        e = lm.p("model.embed_tokens.weight").float()
        tower.p("mm_projector.post_norm.weight").fill_(float(e.pow(2).mean(-1).sqrt().mean()))
    step, start_seed, log, before = 0, args.seed * 1_000_003 % 500_000, [], 0.0
    if args.resume:
        meta = load_vision(tower, args.resume)
        step, start_seed, log, before = meta["step"], meta["next_seed"], meta["log"], meta["train_seconds"]
        print(f"resumed at step {step}, data seed {start_seed}", flush=True)
    tower.to(dev)
    n_params = sum(p.numel() for p in tower.parameters())
    print(f"vision params {n_params:,}; text model {'TRAINED (replay)' if args.train_text else 'frozen'} "
          f"({sum(p.numel() for p in lm.parameters()):,})", flush=True)

    decay = [p for n, p in tower.named_tensors() if p.dim() >= 2 and "pos_emb" not in n]
    no_decay = [p for n, p in tower.named_tensors() if not (p.dim() >= 2 and "pos_emb" not in n)]
    groups = [{"params": decay, "weight_decay": 0.05, "base": args.lr},
              {"params": no_decay, "weight_decay": 0.0, "base": args.lr}]
    text_it = None
    if args.train_text:
        from .train import Rows
        td = [p for n, p in lm.named_master() if p.dim() >= 2 and "res_proj" not in n]
        tn = [p for n, p in lm.named_master() if not (p.dim() >= 2 and "res_proj" not in n)]
        groups += [{"params": td, "weight_decay": 0.1, "base": args.text_lr},
                   {"params": tn, "weight_decay": 0.0, "base": args.text_lr}]
        text_it = iter(torch.utils.data.DataLoader(Rows(2048, 0, args.text_batch), batch_size=None, num_workers=2,
                                                   prefetch_factor=4))
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    first = step
    # The cosine's clock. A resumed call starts with fresh Adam moments and its own warm-up, so without
    # --total-seconds it runs its own cosine over this call's --time-budget (a warm restart); measuring it from
    # the earlier calls' seconds instead left every resumed call at the 10 % floor from its first step.
    # --total-seconds continues one schedule across calls (its clock = all seconds trained so far).
    sched0 = before if args.total_seconds else 0.0

    def lr_at(s, prog):
        lr = args.lr * min(1.0, (s - first + 1) / args.warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    quick = full = None
    if args.eval_set:
        full = eval_batches(args.eval_set, tok, pad_id, args.eval_limit)
        quick = [(k, i[:40], t[:40], w[:40], n[:40]) for k, i, t, w, n in full]
    loader = torch.utils.data.DataLoader(Batches(args.batch, start_seed, pad_id, task_cycle(args.task_weights)), batch_size=None,
                                         num_workers=args.workers, prefetch_factor=4 if args.workers else None)
    it = iter(loader)
    t_start = time.time()
    t_log, t_eval, n_log = t_start, t_start, 0
    next_seed = start_seed
    try:
        while step - first < args.max_steps and time.time() - t_start < args.time_budget:
            prog = (sched0 + time.time() - t_start) / total
            imgs, ids, w, ns = next(it)
            next_seed = max(next_seed, int(ns))
            ids, w = ids.to(dev, non_blocking=True), w.to(dev, non_blocking=True)
            lr = lr_at(step, prog)
            for gp in opt.param_groups:
                gp["lr"] = lr * gp["base"] / args.lr
            h = forward(lm, tower, imgs, ids, media_id, dev)
            sel = w[:, 1:] > 0
            logits = lm.logits(h[sel])
            loss = F.cross_entropy(logits, ids[:, 1:][sel])
            if text_it is not None:   # replay: k3-tiny's own data, its weighting (train.py)
                tids, tw, _ = next(text_it)
                tids, tw = tids.to(dev), tw.to(dev)
                th = lm.hidden(tids[:, :-1], mode="sparse")
                nll = F.cross_entropy(lm.logits(th).reshape(-1, lm.cfg.vocab_size),
                                      tids[:, 1:].reshape(-1), reduction="none")
                wt = tw[:, 1:].reshape(-1)
                loss = loss + (nll * wt).sum() / wt.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            step += 1
            n_log += imgs.shape[0]
            if step % args.log_every == 0:
                dt = time.time() - t_log
                rec = {"step": step, "loss": round(loss.item(), 4), "gnorm": round(gn.item(), 3), "lr": lr,
                       "samples_per_s": round(n_log / dt, 1), "elapsed_s": round(time.time() - t_start, 1)}
                if quick is not None and time.time() - t_eval >= args.eval_every:
                    rec["quick_eval"] = {k: v["accuracy"] for k, v in evaluate(lm, tower, quick, media_id, dev).items()}
                    t_eval = time.time()
                log.append(rec)
                print(json.dumps(rec), flush=True)
                t_log, n_log = time.time(), 0
    finally:   # whatever happens, keep what was trained
        meta = {"step": step, "next_seed": next_seed, "train_seconds": before + time.time() - t_start, "log": log,
                "params": n_params, "args": vars(args)}
        save_vision(tower, os.path.join(args.out, "vision.safetensors"), meta)
        if args.train_text:
            from .train import save_resume
            save_resume(lm, os.path.join(args.out, "resume"), {"step": step, "log": log, "config": "tiny",
                                                                "args": vars(args), "from": args.text_model})
        del it, loader, text_it
    result = {"step": step, "train_seconds": meta["train_seconds"], "log": log, "vision_config": vc}
    if full is not None:
        t0 = time.time()
        result["eval"] = evaluate(lm, tower, full, media_id, dev)
        result["eval_seconds"] = round(time.time() - t0, 1)
        print(json.dumps({"eval": result["eval"]}), flush=True)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved step {step} to {args.out}/vision.safetensors", flush=True)


if __name__ == "__main__":
    main()
