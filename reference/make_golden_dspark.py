#!/usr/bin/env python3
"""Golden data for the C++ DSpark draft (MODEL.md §5) from the k3ref reference.

    python3 reference/make_checkpoint.py --config nano --out /tmp/k3nano --seed 1
    python3 reference/make_draft.py --config nano --out /tmp/k3nano-dspark --seed 1
    python3 reference/make_golden_dspark.py --ckpt /tmp/k3nano --draft /tmp/k3nano-dspark --out tests/golden/nano-dspark

Two steps of one request, FP64 compute with the spec's BF16 roundings (as make_golden.py):
The prompt is the first seeded 24-token prompt (seeds 11, 12, ...) whose every greedy decision compared by the
C++ test (the target's anchor, each drafted token) has a top-2 logit margin >= 0.05, far above the engine's
FP32/BF16 noise (golden.json `prompt_seed`, `greedy_margins`).
- step1: target prefill of a 24-token prompt with taps → `step1.taps` bf16 [24, n·D]; context injection of all
  24 positions → `step1.h_ctx` bf16 [24, D], `step1.D{l}.ctx_latent` bf16 [24, C+R]; the block
  [anchor, mask × (N−1)] at positions 24..24+N−1, anchor = the target's greedy token → `step1.D{l}.block_latent`,
  `step1.D{l}.attn_out`, `step1.D{l}.mlp_out`, `step1.D{l}.hidden` bf16 [N, D], `step1.block_normed` bf16 [N, D],
  `step1.base_logits` f32 [N, V] (lm_head of the normed block), `step1.draft_logits` f32 [N, V] (Markov-corrected,
  greedy chain), `step1.draft_tokens` i32 [N], `step1.topk_logits` f32 [N, V] (the same chain's logits with
  top-k pruning, k = 8, −inf outside; tokens `step1.topk_tokens`).
- step2: the target continues greedily to 40 tokens; the taps of positions 24..39 are injected (C++ feeds them in
  two calls of 7 and 9 to exercise incremental injection) and a block at position 40 (beyond the YaRN original
  context of 32) is drafted: `step2.taps` [16, n·D], `step2.h_ctx`, `step2.block_normed`, `step2.draft_logits`,
  `step2.draft_tokens`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3ref.dspark import Draft  # noqa: E402
from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402
from make_golden import allowed_ids, is_bf16_exact, make_prompt  # noqa: E402

FORMAT = "kestrel-golden-dspark-v1"
TOPK = 8
MIN_MARGIN = 0.05


def sha_files(d, files):
    import hashlib
    out = {}
    for fn in files:
        h = hashlib.sha256()
        with open(os.path.join(d, fn), "rb") as f:
            h.update(f.read())
        out[fn] = h.hexdigest()
    return out


def put(tensors, name, v, kind):
    if kind == "bf16":
        assert is_bf16_exact(v), name
        tensors[name] = v.to(torch.bfloat16).contiguous()
    elif kind == "f32":
        tensors[name] = v.to(torch.float32).contiguous()
    else:
        tensors[name] = torch.as_tensor(v, dtype=torch.int32).contiguous()


def margins(logits: torch.Tensor) -> list:
    s = torch.sort(logits, dim=-1, descending=True).values
    return (s[:, 0] - s[:, 1]).tolist()


def run_case(model, draft, prompt):
    dc = draft.cfg
    tensors: dict = {}

    # step 1
    st = model.new_state()
    logits = model.prefill(prompt, st)
    taps1 = model.last_taps
    anchor1 = int(logits[-1].argmax())
    ds = draft.new_state()
    cap: dict = {}
    draft.inject(taps1, ds, cap)
    toks, dl = draft.draft_greedy(anchor1, ds, 0, cap)
    put(tensors, "step1.taps", taps1, "bf16")
    put(tensors, "step1.h_ctx", cap["h_ctx"], "bf16")
    for l in range(dc.num_hidden_layers):
        for k in ("ctx_latent", "block_latent", "attn_out", "mlp_out", "hidden"):
            put(tensors, f"step1.D{l}.{k}", cap[f"D{l}.{k}"], "bf16")
    put(tensors, "step1.block_normed", cap["block_normed"], "bf16")
    put(tensors, "step1.base_logits", draft.base_logits(cap["block_normed"]), "f32")
    put(tensors, "step1.draft_logits", dl, "f32")
    put(tensors, "step1.draft_tokens", toks, "i32")
    ttoks, tl = draft.draft_greedy(anchor1, ds, TOPK)
    put(tensors, "step1.topk_logits", tl, "f32")
    put(tensors, "step1.topk_tokens", ttoks, "i32")

    # step 2: the target continues greedily to 40 tokens; inject positions 24..39, draft at 40
    cont = [anchor1]
    lg = model.decode(anchor1, st).unsqueeze(0)
    taps_rows = [model.last_taps]
    while len(prompt) + len(cont) < 40:
        nxt = int(lg[-1].argmax())
        cont.append(nxt)
        lg = model.decode(nxt, st).unsqueeze(0)
        taps_rows.append(model.last_taps)
    taps2 = torch.cat(taps_rows, 0)
    anchor2 = int(lg[-1].argmax())
    cap2: dict = {}
    draft.inject(taps2, ds, cap2)
    toks2, dl2 = draft.draft_greedy(anchor2, ds, 0, cap2)
    put(tensors, "step2.taps", taps2, "bf16")
    put(tensors, "step2.h_ctx", cap2["h_ctx"], "bf16")
    put(tensors, "step2.block_normed", cap2["block_normed"], "bf16")
    put(tensors, "step2.draft_logits", dl2, "f32")
    put(tensors, "step2.draft_tokens", toks2, "i32")

    m_all = margins(dl) + margins(tl) + margins(dl2) + margins(logits[-1:])
    info = {"step1": {"prompt": prompt, "anchor": anchor1, "context_len": len(prompt)},
            "step2": {"continuation": cont, "anchor": anchor2, "context_len": len(prompt) + len(cont),
                      "inject_splits": [7, len(cont) - 7]},
            "greedy_margins": {"step1": margins(dl), "step1_topk": margins(tl), "step2": margins(dl2)},
            "min_margin": min(m_all), "tokens": (toks, ttoks, toks2)}
    return tensors, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    ck = Checkpoint(args.ckpt, torch.float64)
    model = Model(ck)
    draft = Draft(args.draft, model)
    dc = draft.cfg
    model.tap_layers = dc.target_layer_ids
    N = dc.block_size
    allowed = allowed_ids(ck)
    # The engine computes in FP32 with BF16 roundings, so a greedy decision whose top-2 margin is within its
    # noise may flip; pick the first prompt seed whose every drafted decision has a margin >= MIN_MARGIN.
    for prompt_seed in range(11, 111):
        tensors, info = run_case(model, draft, make_prompt(allowed, 24, prompt_seed))
        if info["min_margin"] >= MIN_MARGIN:
            break
    else:
        raise SystemExit("no prompt seed with healthy greedy margins")
    info["prompt_seed"] = prompt_seed
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "golden.safetensors"), metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "generator": "python3 reference/make_golden_dspark.py " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "regenerate": ["python3 reference/make_checkpoint.py --config nano --out DIR --seed 1",
                       "python3 reference/make_draft.py --config nano --out DRAFT --seed 1",
                       f"python3 reference/make_golden_dspark.py --ckpt DIR --draft DRAFT --out {args.out}"],
        "checkpoint": {"sha256": ck.fingerprint()},
        "draft": {"sha256": sha_files(args.draft, ["config.json", "model.safetensors"])},
        "reference": {"torch": torch.__version__, "compute_dtype": "float64", "mla_form": "naive"},
        "block_size": N, "topk": TOPK,
        "prompt_seed": info["prompt_seed"], "min_greedy_margin": MIN_MARGIN,
        "greedy_margins": info["greedy_margins"],
        "step1": info["step1"], "step2": info["step2"],
    }
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
    print("prompt seed", info["prompt_seed"], "draft tokens", info["tokens"], "min margin", info["min_margin"])


if __name__ == "__main__":
    main()
