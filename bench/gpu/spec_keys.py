#!/usr/bin/env python3
"""Turns one `bench/gpu/run.sh spec` run into perf.json's dspark_* keys (issue #19 point 5).

    spec_keys.py --dir OUT [--perf bench/gpu/perf.json] [--commit SHA] [--machine TEXT]

Reads the `kestrel bench --result-file` JSONs that run.sh spec writes as OUT/spec_<model>_<mode>_c<C>.json
(model: k3tiny with models/k3-tiny-dspark on random prompts, k3tinytasks / k3tinytaskseos the same on k3-tiny's
eval prompts past / stopping at EOS, mini = the reduced mini with a random draft; mode: plain, host,
gpu, gpueager = gpu with eager verify steps, gpuperreq = gpu with the per-request draft, gpugraph = gpu with
the batched draft in CUDA graphs — since issue #19 point 4 that is gpu itself —, gpunograph = gpu with the draft's
graphs off, gpuabs = gpu with the draft's attention absorbed) and writes them into perf.json under "dspark" with their own date, commit and command (they come from a
different run than the rest of perf.json, so they are kept apart and say so), then prints a markdown table.

Keys: dspark_<model>_tpot_ms_c<C>_<mode> (median TPOT), dspark_<model>_accept_len_c<C>_<mode> (1 + accepted
draft tokens per draft, vLLM's mean acceptance length), dspark_<model>_speedup_c<C>_<mode> (plain TPOT / spec
TPOT). The projection for real shapes: a random draft is almost never accepted, so the reduced mini's
speculative TPOT is the cost of one speculative step (draft + verify of 1 + γ rows, one token out); divided by
k3-tiny's measured acceptance length it is the TPOT a trained draft of that acceptance would give at these
shapes: dspark_mini_projected_tpot_ms_c1_<mode> and dspark_mini_projected_speedup_c1_<mode>.
"""
import argparse
import datetime
import json
import math
import pathlib
import re
import sys


def read(folder):
    runs = {}
    for p in sorted(pathlib.Path(folder).glob("spec_*_c*.json")):
        m = re.match(r"^spec_(k3tinytaskseos|k3tinytasks|k3tiny|mini)_"
                     r"(plain|host|gpu|gpueager|gpuperreq|gpugraph|gpunograph|gpuabs)_c(\d+)\.json$", p.name)
        if not m:
            continue
        r = json.loads(p.read_text())
        runs[(m.group(1), m.group(2), int(m.group(3)))] = r
    return runs


def keys(runs):
    v = {}
    for (model, mode, c), r in sorted(runs.items()):
        v[f"dspark_{model}_tpot_ms_c{c}_{mode}"] = r.get("median_tpot_ms", math.nan)
        if mode != "plain" and "spec_decode_acceptance_length" in r:
            v[f"dspark_{model}_accept_len_c{c}_{mode}"] = r["spec_decode_acceptance_length"]
    for (model, mode, c), r in sorted(runs.items()):
        plain = runs.get((model, "plain", c))
        if model != "mini" and mode != "plain" and plain:
            t = r.get("median_tpot_ms")
            if t:
                v[f"dspark_{model}_speedup_c{c}_{mode}"] = plain["median_tpot_ms"] / t
    for mode in ("host", "gpu", "gpueager", "gpuperreq", "gpugraph", "gpunograph", "gpuabs"):
        step = v.get(f"dspark_mini_tpot_ms_c1_{mode}")
        acc = v.get(f"dspark_k3tiny_accept_len_c1_{mode}")
        plain = v.get("dspark_mini_tpot_ms_c1_plain")
        if step and acc and plain:
            v[f"dspark_mini_projected_tpot_ms_c1_{mode}"] = step / acc
            v[f"dspark_mini_projected_speedup_c1_{mode}"] = plain / (step / acc)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--perf", default="bench/gpu/perf.json")
    ap.add_argument("--commit", default="")
    ap.add_argument("--machine", default="")
    a = ap.parse_args()
    v = keys(read(a.dir))
    if not v:
        print(f"spec_keys: no spec_*_c*.json in {a.dir}", file=sys.stderr)
        return 1
    p = pathlib.Path(a.perf)
    doc = json.loads(p.read_text()) if p.exists() else {}
    doc["dspark"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": a.commit,
        "machine": a.machine,
        "command": "bench/gpu/run.sh spec (its own run, not the perf run above)",
        "keys": {k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in sorted(v.items())},
    }
    p.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"\n### bench/gpu/run.sh spec — {doc['dspark']['date']}, {a.machine}, commit {a.commit}\n")
    print("| key | value |\n|---|---|")
    for k, x in sorted(v.items()):
        print(f"| {k} | {x:.3f} |" if isinstance(x, float) else f"| {k} | {x} |")
    t1 = v.get("dspark_k3tiny_speedup_c1_gpu") or v.get("dspark_k3tiny_speedup_c1_host")
    if t1:
        print(f"\nsingle-request TPOT with speculation / without (k3-tiny): {1 / t1:.2f} (target ≤ 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
