"""DSpark acceptance per evaluation task, greedy equality, and the draft's model card (issue #19, point 4).

    python3 -m k3data.spec_eval measure --model ../models/k3-tiny --draft ../models/k3-tiny-dspark \
        --out ../models/k3-tiny-dspark/spec_eval.json [--limit 40] [--tasks passkey,tool,arith,chat]
    python3 -m k3data.spec_eval card --draft ../models/k3-tiny-dspark --spec ../models/k3-tiny-dspark/spec_eval.json \
        --train ../models/k3-tiny-dspark/train_dspark.json        # writes DRAFT/README.md

`measure` runs every task's set (models/k3-tiny/eval/TASK.jsonl; `--limit N` keeps N items spread evenly over
the file, so every effort / depth / kind is represented) through the C++ engine on the CPU twice with
`kestrel generate --prompts-file` (greedy, prompts from chat.encode_chat as k3data.engine_eval builds them):
once plain, once with `--speculative-config {"method":"dspark","model":DRAFT,"num_speculative_tokens":K}`.
The speculative run prints the engine's vLLM counters (drafts, draft tokens, accepted); the task's mean
acceptance length is 1 + accepted / drafts (vLLM's definition: tokens emitted per verification step).  Every
item's tokens with and without speculation are compared: greedy speculation must change nothing.

`card` fills train/k3data/dspark_card.md from the measurement, the trainer's summary (k3train.train_dspark's
train_dspark.json) and the draft's config.json.  No torch: CI tests the parsing and the card.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import string
import subprocess
import tempfile
import time

from . import chat

TASKS = ("passkey", "tool", "arith", "chat")
TARGET_ACCEPTANCE = 3.0
HERE = os.path.dirname(os.path.abspath(__file__))

SPEC_RE = re.compile(r"^speculative: (\d+) drafts, (\d+) draft tokens, (\d+) accepted; acceptance length ([\d.]+)$",
                     re.M)


def parse_generate(out: str, n: int) -> dict:
    """`kestrel generate` stdout -> {"tokens": [n lists], "drafts", "draft_tokens", "accepted"} (0 without
    speculation)."""
    if n == 1:
        m = re.search(r"^tokens: ?(.*)$", out, re.M)
        toks = {0: m.group(1)} if m else {}
    else:
        toks = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\[(\d+)\] tokens: ?(.*)$", out, re.M)}
    if sorted(toks) != list(range(n)):
        raise ValueError(f"kestrel generate printed tokens for {len(toks)} of {n} prompts")
    res = {"tokens": [[int(x) for x in toks[i].split(",") if x] for i in range(n)],
           "drafts": 0, "draft_tokens": 0, "accepted": 0}
    m = SPEC_RE.search(out)
    if m:
        res.update(drafts=int(m.group(1)), draft_tokens=int(m.group(2)), accepted=int(m.group(3)))
    return res


def pick(records: list, limit: int) -> list:
    """`limit` records spread evenly over the set (all when limit <= 0 or the set is smaller)."""
    if limit <= 0 or limit >= len(records):
        return records
    return [records[(i * len(records)) // limit] for i in range(limit)]


def generate(kestrel, model, prompts, max_tokens, spec=None, max_num_seqs=16):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for p in prompts:
            f.write("ids:" + ",".join(map(str, p)) + "\n")
        path = f.name
    cmd = [kestrel, "generate", "--model", model, "--prompts-file", path, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--max-num-seqs", str(max_num_seqs)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    t0 = time.time()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    res = parse_generate(out, len(prompts))
    res["seconds"] = round(time.time() - t0, 2)
    return res


def task_result(plain: dict, spec: dict, ids: list) -> dict:
    """Summary of one task's two runs."""
    diff = [ids[i] for i, (a, b) in enumerate(zip(plain["tokens"], spec["tokens"])) if a != b]
    gen = sum(len(t) for t in spec["tokens"])
    d = spec["drafts"]
    return {"items": len(ids), "generated_tokens": gen, "drafts": d, "draft_tokens": spec["draft_tokens"],
            "accepted_tokens": spec["accepted"],
            "acceptance_length": round(1 + spec["accepted"] / d, 3) if d else None,
            "greedy_identical": len(ids) - len(diff), "greedy_differences": diff,
            "seconds_plain": plain["seconds"], "seconds_spec": spec["seconds"]}


def overall(tasks: dict) -> dict:
    """Mean over tasks (each task counts once: the target is 'mean acceptance length on its eval tasks') and the
    pooled value (all verification steps together)."""
    acc = [t["acceptance_length"] for t in tasks.values() if t["acceptance_length"] is not None]
    drafts = sum(t["drafts"] for t in tasks.values())
    accepted = sum(t["accepted_tokens"] for t in tasks.values())
    return {"mean_over_tasks": round(sum(acc) / len(acc), 3) if acc else None,
            "pooled": round(1 + accepted / drafts, 3) if drafts else None,
            "greedy_differences": sum(len(t["greedy_differences"]) for t in tasks.values()),
            "items": sum(t["items"] for t in tasks.values())}


def measure(a):
    tok = chat.Tokenizer(a.model)
    spec = {"method": "dspark", "model": os.path.abspath(a.draft), "num_speculative_tokens": a.k}
    out = {"model": a.model, "draft": a.draft, "speculative_config": spec, "limit": a.limit, "tasks": {}}
    for task in a.tasks.split(","):
        with open(os.path.join(a.eval_dir or os.path.join(a.model, "eval"), f"{task}.jsonl")) as f:
            records = pick([json.loads(line) for line in f], a.limit)
        prompts = [chat.encode_chat(tok, r["request"]["messages"], tools=r["request"].get("tools"),
                                    reasoning_effort=r["request"].get("reasoning_effort")) for r in records]
        mt = a.max_tokens or max(r["request"].get("max_tokens", 256) for r in records)
        plain = generate(a.kestrel, a.model, prompts, mt, None, a.max_num_seqs)
        sp = generate(a.kestrel, a.model, prompts, mt, spec, a.max_num_seqs)
        out["tasks"][task] = r = task_result(plain, sp, [x["id"] for x in records])
        print(json.dumps({"task": task, **{k: v for k, v in r.items() if k != "greedy_differences"},
                          "greedy_differences": len(r["greedy_differences"])}), flush=True)
    out["overall"] = overall(out["tasks"])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["overall"]))
    return out


# ---- the model card -----------------------------------------------------------------------------------------
def _fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def card_text(cfg: dict, spec: dict, train: dict | None, template: str) -> str:
    rows = []
    for task, t in spec["tasks"].items():
        rows.append(f"| {task} | {t['items']} | {t['generated_tokens']:,} | {t['drafts']:,} | "
                    f"{t['accepted_tokens']:,} | **{_fmt(t['acceptance_length'])}** | "
                    f"{t['greedy_identical']} / {t['items']} | {t['seconds_plain']:.0f} s / {t['seconds_spec']:.0f} s |")
    ov = spec["overall"]
    mean = ov["mean_over_tasks"]
    verdict = ("met" if mean is not None and mean >= TARGET_ACCEPTANCE and ov["greedy_differences"] == 0
               else "NOT met")
    v = {"eval_rows": "\n".join(rows), "mean_acceptance": _fmt(mean), "pooled_acceptance": _fmt(ov["pooled"]),
         "greedy_differences": str(ov["greedy_differences"]), "items": str(ov["items"]), "verdict": verdict,
         "k": str(spec["speculative_config"]["num_speculative_tokens"]),
         "limit": "all items" if not spec.get("limit") else f"{spec['limit']} items per task (spread over the set)"}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "markov_rank",
                "num_speculative_tokens", "mask_token_id", "rope_theta"):
        v[key] = str(cfg[key])
    v["target_layer_ids"] = ", ".join(map(str, cfg["target_layer_ids"]))
    rs = cfg.get("rope_scaling") or {}
    v["rope_scaling"] = (f"YaRN ×{rs['factor']:g} over {rs['original_max_position_embeddings']:,} positions"
                         if rs else "none")
    if train:
        ta = train["args"]
        v.update(device=train.get("device", "?"), train_seconds=f"{train['train_seconds']:.0f}",
                 steps=f"{train['steps']:,}", rows=f"{train['rows']:,}", tokens=f"{train['tokens']:,}",
                 params=f"{train['draft_params']:,}", nbytes=f"{train['draft_bytes']:,}",
                 anchors=str(ta["anchors"]), reuse=str(ta["reuse"]), lr=str(ta["lr"]), decay=str(ta["decay"]),
                 labels=ta["labels"], batch=str(ta["batch"]), seq=f"{ta['seq']:,}")
        log = train.get("log") or []
        picks = [log[i] for i in sorted({0, len(log) // 4, len(log) // 2, 3 * len(log) // 4, len(log) - 1})] if log else []
        v["loss_rows"] = "\n".join(
            f"| {r['step']:,} | {r['elapsed_s']:.0f} | {r['loss']:.3f} | "
            + " ".join(f"{x:.2f}" for x in r["agreement_by_position"]) + " |" for r in picks) or "| — | | | |"
        ho = train.get("held_out") or {}
        v["held_out_rows"] = "\n".join(
            f"| {t} | {h['blocks']} | {_fmt(h['acceptance_estimate'])} | "
            + " ".join(f"{x:.2f}" for x in h["agreement_by_position"]) + " |" for t, h in ho.items()) or "| — | | | |"
    else:
        for k in ("device", "train_seconds", "steps", "rows", "tokens", "params", "nbytes", "anchors", "reuse", "lr",
                  "decay", "labels", "batch", "seq"):
            v[k] = "?"
        v["loss_rows"] = v["held_out_rows"] = "| — | | | |"
    return string.Template(template).substitute(v)


def card(a):
    with open(os.path.join(a.draft, "config.json")) as f:
        cfg = json.load(f)
    with open(a.spec) as f:
        spec = json.load(f)
    train = None
    if a.train and os.path.exists(a.train):
        with open(a.train) as f:
            train = json.load(f)
    with open(a.template) as f:
        template = f.read()
    text = card_text(cfg, spec, train, template)
    out = a.out or os.path.join(a.draft, "README.md")
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="acceptance per task + greedy equality through kestrel generate")
    m.add_argument("--model", required=True)
    m.add_argument("--draft", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--kestrel", default=os.path.join(HERE, "..", "..", "build", "src", "cli", "kestrel"))
    m.add_argument("--eval-dir", default=None, help="default: MODEL/eval")
    m.add_argument("--tasks", default=",".join(TASKS))
    m.add_argument("--limit", type=int, default=0, help="items per task, spread over the set (0: all)")
    m.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    m.add_argument("--max-tokens", type=int, default=0, help="0: the largest max_tokens of the task's requests")
    m.add_argument("--max-num-seqs", type=int, default=16)
    c = sub.add_parser("card", help="fill the model card from a measurement")
    c.add_argument("--draft", required=True)
    c.add_argument("--spec", required=True)
    c.add_argument("--train", default=None, help="k3train.train_dspark's train_dspark.json")
    c.add_argument("--template", default=os.path.join(HERE, "dspark_card.md"))
    c.add_argument("--out", default=None, help="default: DRAFT/README.md")
    a = ap.parse_args(argv)
    measure(a) if a.cmd == "measure" else card(a)


if __name__ == "__main__":
    main()
