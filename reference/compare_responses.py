#!/usr/bin/env python3
"""Item-for-item agreement of two answer files (`kestrel eval --out X --save-responses` and/or
reference/eval_ref.py's output): how many items both answered, how many answers are identical (content and
tool calls), and the ids that differ.

    python3 reference/compare_responses.py engine.json ref.json [--show 10]

Exit status 0 always (it reports; the judgement is the reader's, with the numbers beside the scores).
"""
from __future__ import annotations

import argparse
import json


def answers(path):
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for it in doc.get("items", []):
        r = it.get("response")
        if r is None:
            out[it["id"]] = None
            continue
        calls = [(c.get("name"), c.get("arguments")) for c in r.get("tool_calls") or []]
        out[it["id"]] = (r.get("content") or "", r.get("finish_reason"), calls)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--show", type=int, default=10)
    x = ap.parse_args(argv)
    a, b = answers(x.a), answers(x.b)
    both = [i for i in a if i in b and a[i] is not None and b[i] is not None]
    same = [i for i in both if a[i] == b[i]]
    diff = [i for i in both if a[i] != b[i]]
    print(f"{len(both)} items answered in both; {len(same)} identical, {len(diff)} different")
    for i in diff[:x.show]:
        print(f"  {i}: {a[i][0]!r} vs {b[i][0]!r}")


if __name__ == "__main__":
    main()
