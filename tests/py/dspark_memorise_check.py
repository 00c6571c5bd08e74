"""Manual end-to-end check (not collected by pytest; ~6 CPU-minutes, needs torch): the draft trainer and the
C++ engine agree on what a DSpark block is (which context rows, positions, anchor, Markov prev).

One tool prompt of models/k3-tiny's eval set and k3-tiny's greedy 64-token continuation (`kestrel generate`)
form one training row; the trainer's K3Model gives the taps and logits (its argmax must be the engine's
greedy continuation), k3train.dspark trains a fresh draft on every anchor of the continuation for ≤ 300 s,
exports it, and the engine speculates with it on the same prompt.  A memorised draft must be accepted mostly
whole, and the tokens must equal the plain run's.  Measured 2026-12-01 (CPU, 41 steps): teacher-forced
estimate 3.48, engine acceptance length 5.25 (12 drafts, 51 of 79 draft tokens accepted), tokens identical.
An off-by-one between trainer and engine (context row of the anchor, RoPE positions, Markov prev) gives ~1.

    cd train && PYTHONPATH=. python3 ../tests/py/dspark_memorise_check.py
"""
import json
import os
import re
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat  # noqa: E402
from k3train import train_dspark as td  # noqa: E402
from k3train.dspark import DSparkDraft, draft_config, export  # noqa: E402
from k3train.evaluate import load_exported  # noqa: E402

K = os.environ.get("KESTREL_BIN", os.path.join(ROOT, "build", "src", "cli", "kestrel"))
MODEL = os.path.join(ROOT, "models", "k3-tiny")
OUT = os.environ.get("OUT_DIR", "/tmp/dspark_memorise/draft")


def generate(prompt, *extra):
    out = subprocess.run([K, "generate", "--model", MODEL, "--prompt-tokens", ",".join(map(str, prompt)),
                          "--max-tokens", "64", "--temperature", "0", *extra], capture_output=True, text=True,
                         check=True).stdout
    return [int(x) for x in re.search(r"^tokens: (.*)$", out, re.M).group(1).split(",")], out


def main():
    torch.set_num_threads(2)
    tok = chat.Tokenizer(MODEL)
    with open(os.path.join(MODEL, "eval", "tool.jsonl")) as f:
        r = [json.loads(line) for line in f][1]
    p = chat.encode_chat(tok, r["request"]["messages"], tools=r["request"].get("tools"))
    gen, _ = generate(p)
    ids = torch.tensor([p + gen])
    w = torch.tensor([[0.1] * len(p) + [1.0] * len(gen)])
    target = load_exported(MODEL, torch.device("cpu"))
    target.requires_grad_(False)
    target.freeze_quant()
    d = DSparkDraft(draft_config())
    taps, tl = td.target_pass(target, ids, d.cfg.target_layer_ids, "sparse")
    agree = float((tl[0, len(p) - 1:-1].argmax(-1) == ids[0, len(p):]).float().mean())
    print("trainer target argmax == engine greedy:", agree, flush=True)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    args = types.SimpleNamespace(decay=0.8, context_weight=0.1, labels="target")
    anchors = torch.arange(len(p), ids.shape[1] - 1).unsqueeze(0)
    t0 = time.time()
    for s in range(400):
        if time.time() - t0 > 300:
            break
        for gp in opt.param_groups:
            gp["lr"] = 3e-3 * min(1, (s + 1) / 10)
        loss, m, v = td.block_loss(d, target, ids, w, anchors, tl, taps, args, tok.special("[PAD]"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s % 10 == 0:
            est, _ = td.acceptance_estimate(m, v)
            print(json.dumps({"step": s, "loss": round(loss.item(), 3), "estimate": round(est, 2)}), flush=True)
            if est > 6.5:
                break
    export(d, OUT)
    spec = json.dumps({"method": "dspark", "model": OUT, "num_speculative_tokens": 7})
    gen2, out = generate(p, "--speculative-config", spec)
    print("identical to the plain run:", gen2 == gen)
    print(*[line for line in out.splitlines() if line.startswith("speculative")])


if __name__ == "__main__":
    main()
