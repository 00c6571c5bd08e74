#!/usr/bin/env python3
"""Write golden data for the C++ engine from a checkpoint, using the k3ref reference model.

    python3 reference/make_checkpoint.py --config nano --out /tmp/k3nano --seed 1
    python3 reference/make_golden.py --ckpt /tmp/k3nano --out tests/golden/nano

Outputs `<out>/golden.json` (fingerprint, generator command, cases) and `<out>/golden.safetensors`.
Tensor names, dtypes and shapes: see reference/README.md ("Golden data").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402

FORMAT = "kestrel-golden-v1"
PROMPT_SEED = 1234


def special_ids(ck: Checkpoint) -> set:
    cfg = ck.cfg
    with open(os.path.join(ck.dir, "config.json")) as f:
        top = json.load(f)
    ids = {0, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, top.get("pad_token_id"),
           top.get("bos_token_id"), top.get("eos_token_id"), top.get("media_placeholder_token_id")}
    return {int(i) for i in ids if isinstance(i, int)}


def allowed_ids(ck: Checkpoint) -> torch.Tensor:
    """Ordinary (base BPE) ids.  K3 layout (MODEL.md §7): ids [0, V−256) are base tokens, the top 256 are
    special slots.  Also excluded: id 0, every id named in config.json, and every id in
    tokenizer_config.json `added_tokens_decoder` (when the checkpoint ships one)."""
    V = ck.cfg.vocab_size
    hi = V - 256 if V > 512 else V
    bad = special_ids(ck)
    tok_cfg = os.path.join(ck.dir, "tokenizer_config.json")
    if os.path.exists(tok_cfg):
        with open(tok_cfg) as f:
            bad |= {int(k) for k in json.load(f).get("added_tokens_decoder", {})}
    return torch.tensor([i for i in range(1, hi) if i not in bad], dtype=torch.int64)


def make_prompt(allowed: torch.Tensor, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(PROMPT_SEED + seed)
    return allowed[torch.randint(0, allowed.numel(), (n,), generator=g)].tolist()


def is_bf16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.to(torch.bfloat16).to(t.dtype), t))


def store(tensors: dict, case: str, cap: dict) -> list:
    """Convert a capture dict into stored tensors `{case}.{key}`; returns the stored names (sorted)."""
    names = []
    for k, v in cap.items():
        name = f"{case}.{k}"
        if k == "logits" or k.endswith(("router_weights", "router_margin", "index_margin")):
            t = v.to(torch.float32)
        elif v.is_floating_point():
            if not is_bf16_exact(v):
                raise AssertionError(f"{name} is not BF16-exact")
            t = v.to(torch.bfloat16)
        else:
            t = v.to(torch.int32)
        tensors[name] = t.contiguous()
        names.append(name)
    return sorted(names, key=_name_key)


def _name_key(n: str):
    parts = n.split(".")
    if len(parts) >= 3 and parts[1].startswith("L") and parts[1][1:].isdigit():
        return (0, int(parts[1][1:]), parts[2])
    return (1, 0, parts[-1])


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sensitivity(ck_dir: str, reqs: list, ref_cap: dict, n_layers: int) -> dict:
    """How much an FP32-compute run of the same reference moves away from the FP64 golden: a floor for what
    an engine with FP32 accumulation can expect end to end (router/indexer decisions can flip)."""
    m32 = Model(ck_dir, dtype=torch.float32)
    cap: dict = {}
    m32.prefill_batch(reqs, capture=cap)
    first_bad = None
    for L in range(n_layers):
        if rel(cap[f"L{L}.mlp_out"], ref_cap[f"L{L}.mlp_out"]) > 2e-2:
            first_bad = L
            break
    out = {
        "logits_rel_l2": rel(cap["logits"], ref_cap["logits"]),
        "greedy_match": float((cap["logits"].argmax(-1) == ref_cap["logits"].argmax(-1)).double().mean()),
        "first_layer_mlp_out_rel_l2_over_2e-2": first_bad,
        "router_rows_differing": int(sum(int((cap[k] != ref_cap[k]).any(-1).sum()) for k in cap
                                         if k.endswith("router_ids"))),
        "index_rows_differing": int(sum(int((cap[k] != ref_cap[k]).any(-1).sum()) for k in cap
                                        if k.endswith("index_topk"))),
    }
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (released layout)")
    ap.add_argument("--out", required=True, help="output directory, e.g. tests/golden/nano")
    ap.add_argument("--name", default="nano", help="config name recorded in golden.json")
    ap.add_argument("--checkpoint-cmd", default="python3 reference/make_checkpoint.py --config nano --out DIR --seed 1",
                    help="command that produced --ckpt (recorded in golden.json)")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the FP32-compute sensitivity runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny ops; more threads only add overhead

    ck = Checkpoint(args.ckpt, torch.float64)
    cfg = ck.cfg
    model = Model(ck)
    allowed = allowed_ids(ck)
    topk = cfg.index_topk
    long_len = max(150, topk + 86) if topk else 150

    cases_spec = [
        ("short", "prefill", [make_prompt(allowed, 8, 1)]),
        ("medium", "prefill", [make_prompt(allowed, 40, 2)]),
        ("long", "prefill", [make_prompt(allowed, long_len, 3)]),
        ("batch", "batch", [make_prompt(allowed, 5, 4), make_prompt(allowed, 12, 5), make_prompt(allowed, 27, 6)]),
    ]
    tensors: dict = {}
    cases = []
    for name, kind, reqs in cases_spec:
        cap: dict = {}
        model.prefill_batch(reqs, capture=cap)
        entry = {"name": name, "kind": kind, "num_tokens": sum(len(r) for r in reqs)}
        if kind == "batch":
            entry["requests"] = reqs
            entry["lengths"] = [len(r) for r in reqs]
        else:
            entry["tokens"] = reqs[0]
        if not args.no_sensitivity:
            entry["fp32_compute_sensitivity"] = sensitivity(args.ckpt, reqs, cap, cfg.num_hidden_layers)
        entry["tensors"] = store(tensors, name, cap)
        cases.append(entry)
        print(f"case {name}: {entry['num_tokens']} tokens", flush=True)

    # prefill N, then M single-token decode steps (greedy over ordinary ids, fed back)
    N, M = 20, 8
    prompt = make_prompt(allowed, N, 7)
    st = model.new_state()
    caps = [{}]
    rows = [model.prefill(prompt, st, caps[0])]
    allowed_mask = torch.full((cfg.vocab_size,), -torch.inf)
    allowed_mask[allowed] = 0.0
    decode_tokens = []
    for _ in range(M):
        nxt = int((rows[-1][-1] + allowed_mask).argmax())
        decode_tokens.append(nxt)
        caps.append({})
        rows.append(model.decode(nxt, st, caps[-1]).unsqueeze(0))
    cap = {k: torch.cat([c[k] for c in caps], dim=0) for k in caps[0]}
    full = prompt + decode_tokens
    check = model.prefill(full, model.new_state())
    agree = rel(cap["logits"], check)
    assert agree < 1e-5, f"prefill+decode disagrees with one prefill: {agree}"
    entry = {"name": "prefill_decode", "kind": "prefill_decode", "num_tokens": N + M, "tokens": full,
             "prefill_len": N, "decode_tokens": decode_tokens,
             "note": "rows [0, prefill_len) come from one prefill of tokens[:prefill_len]; row prefill_len+i from "
                     "decode step i fed tokens[prefill_len+i]; decode tokens = greedy (ordinary ids) of the "
                     "previous row",
             "prefill_decode_vs_single_prefill_logits_rel_l2": agree}
    if not args.no_sensitivity:
        entry["fp32_compute_sensitivity"] = sensitivity(args.ckpt, [full], cap, cfg.num_hidden_layers)
    entry["tensors"] = store(tensors, "prefill_decode", cap)
    cases.append(entry)
    print(f"case prefill_decode: {N}+{M} tokens", flush=True)

    os.makedirs(args.out, exist_ok=True)
    tfile = "golden.safetensors"
    save_file(tensors, os.path.join(args.out, tfile), metadata={"format": FORMAT})
    gen_cmd = "python3 reference/make_golden.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    meta = {
        "format": FORMAT,
        "generator": gen_cmd,
        "regenerate": [args.checkpoint_cmd,
                       f"python3 reference/make_golden.py --ckpt DIR --out {args.out}"],
        "checkpoint": {"name": args.name, "sha256": ck.fingerprint()},
        "reference": {"torch": torch.__version__, "compute_dtype": "float64", "mla_form": "naive",
                      "kda_prefill": "chunked WY/UT, C=64", "kda_decode": "recurrent",
                      "bf16_rounding": "single correct rounding from float64 (see reference/README.md)"},
        "model": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "kda_layers_0idx": [L for L in range(cfg.num_hidden_layers)
                                                                     if cfg.is_kda(L)],
                  "mla_layers_0idx": [L for L in range(cfg.num_hidden_layers) if cfg.is_mla(L)],
                  "moe_layers_0idx": [L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L)],
                  "index_topk": topk, "num_experts_per_token": cfg.num_experts_per_token},
        "tensor_file": tfile,
        "tensor_layout": {
            "{case}.L{L}.attn_in": "bf16 [T, D] x_attn_in, the AttnRes Mix result (BF16-rounded)",
            "{case}.L{L}.attn_out": "bf16 [T, D] a, the attention (KDA/MLA) output",
            "{case}.L{L}.mlp_in": "bf16 [T, D] x_mlp_in, the second Mix result",
            "{case}.L{L}.mlp_out": "bf16 [T, D] m, the MLP/MoE output",
            "{case}.L{L}.index_topk": "i32 [T, index_topk] MLA layers: selected key positions (request-local), "
                                      "ascending, -1 padded",
            "{case}.L{L}.router_ids": "i32 [T, K] MoE layers: selected experts in selection order (descending "
                                      "biased score, ties -> lower id)",
            "{case}.L{L}.router_weights": "f32 [T, K] renormalised un-biased sigmoid weights, same order",
            "{case}.L{L}.router_margin": "f32 [T] MoE layers: biased score of the K-th chosen expert minus the best "
                                         "unchosen one (0 = exact tie; small = a fast path may flip)",
            "{case}.L{L}.index_margin": "f32 [T] MLA layers: index score of the last selected key minus the best "
                                        "unselected visible key; +inf when all visible keys are selected",
            "{case}.final_hidden": "bf16 [T, D] final AttnRes Mix result (before model.norm)",
            "{case}.logits": "f32 [T, V]",
            "T": "tokens of the case; batch case: requests flattened in order",
        },
        "cases": cases,
    }
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        text = json.dumps(meta, indent=1)
        # keep integer lists (token ids) on one line
        text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text)
        f.write(text + "\n")
    size = os.path.getsize(os.path.join(args.out, tfile))
    print(f"wrote {args.out}/golden.json and {tfile} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
