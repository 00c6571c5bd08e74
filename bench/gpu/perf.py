#!/usr/bin/env python3
"""Collects one `bench/gpu/run.sh perf` run into bench/gpu/perf.json and a markdown table.

Every benchmark of the run prints its results as lines `PERF <key> <value>` (µs, GB/s, TFLOP/s, %, tok/s ...);
`kestrel bench` writes its vLLM-style result files. This script reads them all from one folder, so every number
in perf.json was measured in the same run, next to the ceilings (copy_gbps, bf16_gemm_tflops) of that run, and
prints the table bench/RESULTS.md takes, with each issue's target beside the key it bounds.

  perf.py --logs DIR [--serve NAME=FILE ...] [--out perf.json] [--commit SHA] [--machine TEXT]

Derived keys (computed here, not measured twice): `*_pct_copy_*` from a time and the bytes a benchmark printed as
`PERF <key>_bytes <n>`, when the benchmark did not print the percentage itself.
"""
import argparse
import datetime
import json
import math
import pathlib
import re
import sys

# key -> (target text, predicate on the value and the whole table, or None when the key is informative only)
TARGETS = {
    "moe_experts_pct_copy_b1": ("≥ 70 % (#14)", lambda v, t: v >= 70),
    "moe_experts_pct_copy_b64": ("≥ 60 % (#14)", lambda v, t: v >= 60),
    "decode_step_mini_us_b1": ("≤ 1.3 × floor (#14)",
                               lambda v, t: "decode_step_mini_floor_us" in t and v <= 1.3 * t["decode_step_mini_floor_us"]),
    "decode_step_mini_us_b64": ("≤ 2 × batch 1 (#14)",
                                lambda v, t: "decode_step_mini_us_b1" in t and v <= 2 * t["decode_step_mini_us_b1"]),
    "mla_decode_pct_copy_b64_s32k": ("≥ 70 % (#15)", lambda v, t: v >= 70),
    "indexer_us_b64_s32k": ("≤ 820 µs, 10× faster than 8.2 ms (#15)", lambda v, t: v <= 820),
    "kda_prefill_us_h12_32k": ("≤ FLA chunk_kda (#15)",
                               lambda v, t: "fla_chunk_kda_us_h12_32k" in t and v <= t["fla_chunk_kda_us_h12_32k"]),
    "kda_decode_us_b1": ("≤ 6.4 µs (#15)", lambda v, t: v <= 6.4),
    "kda_decode_tbps_b1024": ("≥ 3.9 TB/s (#15)", lambda v, t: v >= 3.9),
    "prefill_mini_pct_bf16_peak": ("≥ 40 % (#15)", lambda v, t: v >= 40),
    "serve_mini_ttft_ms_c64_median": ("≤ 150 ms (#15)", lambda v, t: v <= 150),
    "serve_mini_tpot_ms_c64": ("≤ 15 ms (#15)", lambda v, t: v <= 15),
    "passkey_1m_ok": ("1 (#15)", lambda v, t: v == 1),
}

PERF_LINE = re.compile(r"^PERF\s+([A-Za-z0-9_]+)\s+(-?[0-9.eE+-]+|nan|inf)\s*$")


def read_logs(folder):
    vals = {}
    for f in sorted(pathlib.Path(folder).glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = PERF_LINE.match(line.strip())
            if m:
                vals[m.group(1)] = float(m.group(2))
    return vals


def read_serve(specs):
    """NAME=FILE: a `kestrel bench --result-file` JSON; NAME is e.g. serve_mini_c64."""
    vals = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        p = pathlib.Path(path)
        if not p.exists():
            continue
        r = json.loads(p.read_text())
        conc = name.rsplit("_", 1)[-1]  # c1, c64
        base = name.rsplit("_", 1)[0]   # serve_mini
        vals[f"{base}_output_tok_s_{conc}"] = r.get("output_throughput", math.nan)
        vals[f"{base}_tpot_ms_{conc}"] = r.get("median_tpot_ms", math.nan)
        vals[f"{base}_ttft_ms_{conc}_median"] = r.get("median_ttft_ms", math.nan)
        vals[f"{base}_ttft_ms_{conc}_p99"] = r.get("p99_ttft_ms", math.nan)
        vals[f"{base}_itl_ms_{conc}_p99"] = r.get("p99_itl_ms", math.nan)
    return vals


def derive(v):
    copy = v.get("copy_gbps")
    if copy:
        for k in list(v):
            m = re.match(r"^(.*)_bytes(_.*)?$", k)
            if not m:
                continue
            stem, suffix = m.group(1), m.group(2) or ""
            us = v.get(f"{stem}_us{suffix}")
            pct = f"{stem}_pct_copy{suffix}"
            if us and pct not in v:
                v[pct] = 100.0 * (v[k] / us / 1e3) / copy
    return v


def fmt(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", required=True)
    ap.add_argument("--serve", nargs="*", default=[])
    ap.add_argument("--out", default="bench/gpu/perf.json")
    ap.add_argument("--commit", default="")
    ap.add_argument("--machine", default="")
    a = ap.parse_args()
    v = read_logs(a.logs)
    v.update(read_serve(a.serve))
    v = derive(v)
    keys = {k: x for k, x in sorted(v.items()) if not k.endswith("_bytes") and not k.startswith("_")}
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": a.commit,
        "machine": a.machine,
        "command": "bench/gpu/run.sh perf",
        "keys": {k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in keys.items()},
        "targets": {k: {"target": t[0], "met": bool(t[1](keys[k], keys))} for k, t in TARGETS.items() if k in keys},
    }
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"\n### bench/gpu/run.sh perf — {doc['date']}, {a.machine}, commit {a.commit}\n")
    print("| key | value | target | met |\n|---|---|---|---|")
    for k, x in keys.items():
        t = TARGETS.get(k)
        met = "" if t is None else ("yes" if doc["targets"][k]["met"] else "**no**")
        print(f"| {k} | {fmt(x)} | {t[0] if t else ''} | {met} |")
    missing = [k for k in TARGETS if k not in keys]
    if missing:
        print("\nnot measured in this run: " + ", ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
