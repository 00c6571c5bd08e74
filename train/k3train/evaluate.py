"""Evaluate a model with the trainer's own forward (GPU): greedy decoding over the evaluation sets, scored by
the shared rules (k3data/score.py).

    python3 -m k3train.evaluate --model-dir DIR --out scores.json [--sets DIR] [--max-context 65536]
        [--passkey-reps 2] [--tools 200] [--arith 50] [--max-seconds 240]

Sets are read from --sets (JSONL as make_eval.py writes) or generated in memory with make_eval's functions.
The model is loaded from the exported checkpoint (released layout) unless the caller passes the live one.
Prompts are prefilled in pieces of --chunk tokens (state carried), then decoded one token at a time with the
KDA state and the MLA/indexer caches; attention is the sparse top-k path (what the exported model runs).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from k3data import chat, make_eval, score

from .export import tokenizer_dir
from .model import K3Model


def master_from_mxfp4(packed, scale):
    """FP32 master weights that hold an MXFP4 tensor's values AND quantise back to its very bytes (§0.9).
    The plain dequantised values do not always: a block whose largest element rounded down to 3 · 2^e reads as
    6 · 2^(e-1), so the smallest fitting scale is one lower and the block is re-encoded (same values, other
    bytes). Raising that one element by 2^-20 relative keeps the scale (its value still rounds to 3 · 2^e),
    so a model loaded for further training (--init-from) exports unchanged to the bytes it was read from."""
    from k3ref import mxfp4
    w = mxfp4.dequant(packed, scale, torch.float32)
    out, n_in = w.shape
    blocks = w.view(out, n_in // 32, 32)
    amax, arg = blocks.abs().max(-1)
    low = (amax > 0) & (amax <= 3.0 * torch.exp2(scale.float() - 127))
    if bool(low.any()):
        r, b = low.nonzero(as_tuple=True)
        blocks[r, b, arg[r, b]] *= 1.0 + 2.0 ** -20
    return w


def load_exported(model_dir, dev):
    from safetensors import safe_open

    from k3ref import mxfp4
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    m = K3Model(cfg["text_config"])
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    raw = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(model_dir, shard), framework="pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    with torch.no_grad():
        for name, p in m.named_master():
            if ".experts.w" in name:
                base, wn = name[: -len("experts.w1")], name[-2:]
                for e in range(p.shape[0]):
                    k = f"language_model.{base}experts.{e}.{wn}."
                    p[e] = master_from_mxfp4(raw[k + "weight_packed"], raw[k + "weight_scale"])
            else:
                p.copy_(raw["language_model." + name].float())
        for L in range(m.cfg.num_hidden_layers):
            if m.cfg.is_moe(L):
                m.router_bias(L).copy_(raw[f"language_model.model.layers.{L}.block_sparse_moe.gate.e_score_correction_bias"])
    return m.to(dev)


@torch.inference_mode()
def generate_batch(model, prompts, max_tokens, stops, mode="sparse", budget=2 ** 29):
    """Greedy decoding of several prompts at once: left-padded (padding is inert, see K3Model.hidden), prefilled
    in pieces sized so the indexer's [B, T, H_I, S] scores stay under `budget` elements, then one token per step
    for every prompt until each has stopped or used its max_tokens."""
    dev = next(model.parameters()).device
    B, Tm = len(prompts), max(len(p) for p in prompts)
    pad = 0
    x = torch.full((B, Tm), pad, dtype=torch.long, device=dev)
    valid = torch.zeros(B, Tm, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        x[i, Tm - len(p):] = torch.tensor(p, device=dev)
        valid[i, Tm - len(p):] = True
    st = model.new_state()
    chunk = max(32, min(4096, budget // (B * max(1, model.cfg.index_n_heads) * Tm)))
    h = None
    for s in range(0, Tm, chunk):
        h = model.hidden(x[:, s:s + chunk], st, mode, valid=valid[:, s:s + chunk])
    logits = model.logits(h[:, -1])
    outs = [[] for _ in range(B)]
    done = [False] * B
    limit = max(max_tokens) if isinstance(max_tokens, list) else max_tokens
    stop_t = torch.tensor(sorted(stops), device=dev)
    for step in range(limit):
        nxt = torch.argmax(logits, dim=-1)
        nl = nxt.tolist()
        for i in range(B):
            if not done[i]:
                outs[i].append(nl[i])
                mt = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
                if nl[i] in stops or len(outs[i]) >= mt:
                    done[i] = True
        if all(done):
            break
        h = model.hidden(nxt[:, None], st, mode)
        logits = model.logits(h[:, -1])
    del stop_t
    return outs


def run(model, tok, records, max_seconds=1e9, batch=64):
    stops = {tok.special(t) for t in ("<|end_of_msg|>", "[EOS]", "[EOT]")}
    results, t0 = [], time.time()
    prompts = []
    for r in records:
        req = r["request"]
        prompts.append(chat.encode_chat(tok, req["messages"], tools=req.get("tools"),
                                        reasoning_effort=req.get("reasoning_effort")))
    order = sorted(range(len(records)), key=lambda i: len(prompts[i]))
    i = 0
    while i < len(order):
        if time.time() - t0 > max_seconds:
            break
        n = len(prompts[order[i]])
        bsz = max(1, min(batch, (2 ** 20) // max(n, 1)))     # long prompts: smaller batches
        idx = order[i:i + bsz]
        i += bsz
        outs = generate_batch(model, [prompts[j] for j in idx],
                              [records[j]["request"].get("max_tokens", 256) for j in idx], stops)
        for j, out in zip(idx, outs):
            r, req = records[j], records[j]["request"]
            p = chat.parse_output(tok, out, thinking=True,
                                  known_tools=[t["function"]["name"] for t in req.get("tools") or []],
                                  stopped=bool(out) and out[-1] in stops)
            res = {"id": r["id"], "task": r["task"], "meta": r["meta"], "prompt_tokens": len(prompts[j]),
                   "completion_tokens": len(out), "finish_reason": p["finish_reason"],
                   "reasoning": p["reasoning_content"][:300], "content": p["content"][:200]}
            if r["task"] in ("passkey", "arith"):
                res["correct"] = score.last_int_correct(p["content"], r["expect"]["answer"])
            elif r["task"] == "tool":
                res.update(score.tool_scores(p, req.get("tools"), r["expect"]))
                res["tool_calls"] = p["tool_calls"]
            else:
                res["answered"] = p["finish_reason"] == "stop" and bool(p["content"].strip())
            results.append(res)
    return results


def summarize(results):
    s = {}
    pk = [r for r in results if r["task"] == "passkey"]
    if pk:
        grid = {}
        for r in pk:
            c = str(r["meta"]["context_tokens"])
            grid.setdefault(c, {}).setdefault(str(r["meta"]["depth"]), []).append(r["correct"])
        s["passkey"] = {c: {"accuracy": sum(sum(v) for v in d.values()) / sum(len(v) for v in d.values()),
                            "n": sum(len(v) for v in d.values()),
                            "by_depth": {k: sum(v) / len(v) for k, v in d.items()}} for c, d in grid.items()}
    tl = [r for r in results if r["task"] == "tool"]
    if tl:
        called = [r for r in tl if r["called"]]
        s["tool"] = {"n": len(tl), "n_called": len(called),
                     "schema_accuracy": (sum(r["schema_ok"] for r in called) / len(called)) if called else None,
                     "trigger_accuracy": sum(r["trigger_ok"] for r in tl) / len(tl)}
    ar = [r for r in results if r["task"] == "arith"]
    if ar:
        s["arith"] = {}
        for e in sorted({r["meta"]["effort"] for r in ar}):
            rs = [r for r in ar if r["meta"]["effort"] == e]
            s["arith"][e] = {"n": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs),
                             "mean_completion_tokens": sum(r["completion_tokens"] for r in rs) / len(rs)}
    ch = [r for r in results if r["task"] == "chat"]
    if ch:
        s["chat"] = {"n": len(ch), "answered": sum(r["answered"] for r in ch) / len(ch)}
    return s


def main(argv=None, model=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sets", default=None)
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--passkey-reps", type=int, default=2)
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--arith", type=int, default=30)
    ap.add_argument("--chat", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=300, help="time cap per task")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = chat.Tokenizer(tokenizer_dir())
    if model is None:
        model = load_exported(a.model_dir, dev)
    model.eval()
    model.freeze_quant()
    if a.sets:
        sets = {}
        for fn in sorted(os.listdir(a.sets)):
            if fn.endswith(".jsonl"):
                with open(os.path.join(a.sets, fn)) as f:
                    sets[fn[:-6]] = [json.loads(line) for line in f]
    else:
        sets = {"tool": make_eval.tool_set(a.tools), "arith": make_eval.arith_set(a.arith),
                "chat": make_eval.chat_set(a.chat),
                "passkey": make_eval.passkey_set(tok, a.max_context, a.passkey_reps)}
    all_res, timing = [], {}
    for name, recs in sets.items():
        t0 = time.time()
        res = run(model, tok, recs, a.max_seconds)
        timing[name] = {"seconds": round(time.time() - t0, 1), "done": len(res), "total": len(recs)}
        all_res += res
        print(name, json.dumps(summarize(res)), timing[name], flush=True)
    out = {"summary": summarize(all_res), "timing": timing, "results": all_res}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"], indent=1), flush=True)
    model.thaw_quant()
    return out


if __name__ == "__main__":
    main()
