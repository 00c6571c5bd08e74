"""Write the evaluation sets in the shared JSONL format (notes: eval-set format; seeds ≥ 1,000,000).

    python3 -m k3data.make_eval --out models/k3-tiny/eval [--max-context 65536] [--passkey-reps 2]
        [--tools 200] [--arith 50] [--tokenizer DIR]

Files: passkey.jsonl (context lengths 1K, 2K, 4K, ... up to --max-context × depths 0, .25, .5, .75, 1),
tool.jsonl, arith.jsonl (per effort low/high/max), chat.jsonl.  Each line: {"id", "task", "request":
{"messages", "tools"?, "reasoning_effort"?, "max_tokens", "temperature": 0}, "expect", "meta"}.  Passkey
prompts are sized with the real tokenizer so meta.context_tokens is the prompt length to within one sentence.
Deterministic: the same arguments write the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os

from . import chat, gen

EVAL_SEED = 1_000_000
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
EFFORTS = ("low", "high", "max")
MAX_TOKENS = {"passkey": 64, "tool": 256, "arith": 768, "chat": 128}


def _record(cid, conv):
    req = {"messages": conv["messages"][:-1]}
    if conv.get("tools"):
        req["tools"] = conv["tools"]
    if conv.get("reasoning_effort"):
        req["reasoning_effort"] = conv["reasoning_effort"]
    req["max_tokens"] = MAX_TOKENS[conv["task"]]
    req["temperature"] = 0
    return {"id": cid, "task": conv["task"], "request": req, "expect": conv["expect"], "meta": conv["meta"]}


def _first_call_turn(conv):
    """Tool dialogues are scored on the first assistant turn (call or plain answer)."""
    msgs = conv["messages"]
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return dict(conv, messages=msgs[:first + 1])


def passkey_set(tok, max_context=65536, reps=2, min_context=1024, depths=DEPTHS):
    out, ctx, s = [], min_context, EVAL_SEED
    while ctx <= max_context:
        for d in depths:
            for k in range(reps):
                s += 1
                conv = gen.passkey(s, context_tokens=ctx, depth=d, tok=tok)
                out.append(_record(f"passkey-{ctx}-d{d}-s{s}", conv))
        ctx *= 2
    return out


def tool_set(n=200):
    out = []
    for i in range(n):
        s = EVAL_SEED + 100_000 + i
        conv = _first_call_turn(gen.tool(s, kind="nofit" if i % 4 == 3 else "call"))
        out.append(_record(f"tool-{conv['meta']['kind']}-s{s}", conv))
    return out


def arith_set(n_per_effort=50):
    out = []
    for e, effort in enumerate(EFFORTS):
        for i in range(n_per_effort):
            s = EVAL_SEED + 200_000 + e * 10_000 + i
            conv = gen.arith(s, effort=effort)
            out.append(_record(f"arith-{effort}-d{conv['meta']['digits']}-s{s}", conv))
    return out


def chat_set(n=20):
    return [_record(f"chat-s{EVAL_SEED + 300_000 + i}", gen.chat(EVAL_SEED + 300_000 + i)) for i in range(n)]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(here, "..", "..", "tests", "data", "tok_golden"))
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--min-context", type=int, default=1024)
    ap.add_argument("--passkey-reps", type=int, default=2)
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)),
                    help="passkey depths, comma separated (fewer for the 40-second 1M-token prompts)")
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--arith", type=int, default=50, help="problems per effort")
    ap.add_argument("--chat", type=int, default=20)
    a = ap.parse_args(argv)
    tok = chat.Tokenizer(a.tokenizer)
    os.makedirs(a.out, exist_ok=True)
    write_jsonl(os.path.join(a.out, "passkey.jsonl"), passkey_set(tok, a.max_context, a.passkey_reps, a.min_context,
                                                                   tuple(float(d) for d in a.depths.split(","))))
    write_jsonl(os.path.join(a.out, "tool.jsonl"), tool_set(a.tools))
    write_jsonl(os.path.join(a.out, "arith.jsonl"), arith_set(a.arith))
    write_jsonl(os.path.join(a.out, "chat.jsonl"), chat_set(a.chat))


if __name__ == "__main__":
    main()
