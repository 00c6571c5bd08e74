#!/usr/bin/env python3
"""Writes the local lm-evaluation-harness tasks of bench/RESULTS.md ("lm-evaluation-harness") from
k3-tiny's own arithmetic eval set (models/k3-tiny/eval/arith.jsonl), so no dataset is downloaded:
  arith_mc.jsonl   multiple choice (loglikelihood of each answer after the question: local-completions)
  arith_gen.jsonl  the question as a chat message, the number as the target (generate: local-chat-completions)
The task YAMLs next to this file read them (lm_eval --include_path bench/lm_eval)."""
import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parents[1] / "models" / "k3-tiny" / "eval" / "arith.jsonl"

items = [json.loads(l) for l in SRC.read_text().splitlines() if l.strip()]
seen, small = set(), []
for it in items:  # one-digit problems, each question once
    q = it["request"]["messages"][0]["content"]
    if it["meta"]["digits"] == 1 and q not in seen:
        seen.add(q)
        small.append(it)
small = small[:40]
rng = random.Random(0)
with open(HERE / "arith_mc.jsonl", "w") as mc, open(HERE / "arith_gen.jsonl", "w") as gen:
    for it in small:
        q = it["request"]["messages"][0]["content"]
        a = int(it["expect"]["answer"])
        wrong = sorted({a + d for d in (-2, -1, 1, 2, 3, 10)} - {a})
        choices = [str(a)] + [str(w) for w in rng.sample(wrong, 3)]
        rng.shuffle(choices)
        mc.write(json.dumps({"question": q, "choices": choices, "label": choices.index(str(a))}) + "\n")
        gen.write(json.dumps({"question": q, "answer": str(a)}) + "\n")
print(f"{len(small)} items from {SRC}")
