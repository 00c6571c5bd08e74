"""Score evaluation sets with the C++ engine offline: `kestrel generate --prompts-file` (greedy), prompts from
chat.encode_chat, outputs parsed with chat.parse_output, scored with score.py.  A stop-gap measurement tool for
the model card until `kestrel eval` (which talks to a server) is the reference.

    python3 -m k3data.engine_eval --model ../models/k3-tiny --set ../models/k3-tiny/eval/tool.jsonl --out tool.json
    python3 -m k3data.engine_eval --model ../models/k3-tiny --passkey 4096:8192 --reps 1 --out pk.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict

from . import chat, make_eval, score


def run(kestrel, model, tok, records, max_tokens=None, max_num_seqs=16):
    stops = {tok.special(t) for t in ("<|end_of_msg|>", "[EOS]", "[EOT]")}
    prompts = [chat.encode_chat(tok, r["request"]["messages"], tools=r["request"].get("tools"),
                                reasoning_effort=r["request"].get("reasoning_effort")) for r in records]
    mt = max_tokens or max(r["request"].get("max_tokens", 256) for r in records)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for p in prompts:
            f.write("ids:" + ",".join(map(str, p)) + "\n")
        path = f.name
    t0 = time.time()
    try:
        out = subprocess.run([kestrel, "generate", "--model", model, "--prompts-file", path, "--max-tokens", str(mt),
                              "--temperature", "0", "--max-num-seqs", str(max_num_seqs)],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    toks = {int(m.group(1)): [int(x) for x in m.group(2).split(",") if x]
            for m in re.finditer(r"^\[(\d+)\] tokens: ?(.*)$", out, re.M)}
    res = []
    for i, r in enumerate(records):
        ids = toks[i][: r["request"].get("max_tokens", mt)]
        p = chat.parse_output(tok, ids, known_tools=[t["function"]["name"] for t in r["request"].get("tools") or []],
                              stopped=bool(ids) and ids[-1] in stops)
        d = {"id": r["id"], "task": r["task"], "meta": r["meta"], "prompt_tokens": len(prompts[i]),
             "completion_tokens": len(ids), "finish_reason": p["finish_reason"], "content": p["content"][:200]}
        if r["task"] in ("passkey", "arith"):
            d["correct"] = score.last_int_correct(p["content"], r["expect"]["answer"])
        elif r["task"] == "tool":
            d.update(score.tool_scores(p, r["request"].get("tools"), r["expect"]))
            d["tool_calls"] = p["tool_calls"]
        res.append(d)
    return res, time.time() - t0


def summarize(res):
    out = {}
    by = defaultdict(list)
    for d in res:
        if d["task"] == "passkey":
            by[("passkey", d["meta"]["context_tokens"])].append(d["correct"])
        elif d["task"] == "arith":
            by[("arith", d["meta"]["effort"])].append(d["correct"])
    for (t, k), v in sorted(by.items(), key=lambda x: (x[0][0], str(x[0][1]))):
        out.setdefault(t, {})[str(k)] = {"n": len(v), "accuracy": sum(v) / len(v)}
    tl = [d for d in res if d["task"] == "tool"]
    if tl:
        called = [d for d in tl if d["called"]]
        out["tool"] = {"n": len(tl), "n_called": len(called),
                       "schema_accuracy": sum(d["schema_ok"] for d in called) / len(called) if called else None,
                       "trigger_accuracy": sum(d["trigger_ok"] for d in tl) / len(tl)}
    return out


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kestrel", default=os.path.join(here, "..", "..", "build", "src", "cli", "kestrel"))
    ap.add_argument("--set", help="a JSONL evaluation set")
    ap.add_argument("--passkey", help="LO:HI context lengths (powers of two) generated in memory")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    tok = chat.Tokenizer(a.model)
    if a.passkey:
        lo, hi = (int(x) for x in a.passkey.split(":"))
        records = make_eval.passkey_set(tok, hi, a.reps, lo)
    else:
        with open(a.set) as f:
            records = [json.loads(line) for line in f]
    res, dt = run(a.kestrel, a.model, tok, records)
    out = {"summary": summarize(res), "seconds": round(dt, 1), "results": res}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"]))


if __name__ == "__main__":
    main()
