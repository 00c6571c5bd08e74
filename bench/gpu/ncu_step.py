#!/usr/bin/env python3
"""Per-kernel GPU time of one decode step, from `ncu --csv --metrics gpu__time_duration.sum` over
`bench_ops --perf --only model` (bench/gpu/run.sh profile). The model section first prefills each request's
prompt, then runs eager decode steps; every forward begins with the embedding gather, so the kernels between
the STEP-th and the next `embed_kernel` launch (cuda::embed_gather) are one forward. Prints them in launch order with their
durations, then the totals per kernel name, as markdown.

    python3 bench/gpu/ncu_step.py ncu.csv [--step 3]"""
import argparse
import collections
import csv
import re
import sys


def short(name):
    # the compiler's "(anonymous namespace)::", and ncu's "<unnamed>::" for the same thing (the template
    # stripping below would otherwise cut every kernel in an unnamed namespace down to "kestrel::")
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*", "", name)  # drop the argument list
    name = re.sub(r"<.*", "", name)   # and template arguments
    return name.split("::")[-1].strip() or name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--step", type=int, default=3, help="which forward (1 = the first prefill)")
    a = ap.parse_args()
    rows = []
    with open(a.csv, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu prints its own log lines before the table
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1000.0 if unit.startswith("n") else v if unit.startswith("u") else v * 1000.0
        rows.append((int(r["ID"]), r["Kernel Name"], us))
    rows.sort()
    starts = [i for i, (_, n, _) in enumerate(rows) if "embed_kernel" in n]
    if len(starts) < a.step + 1:
        sys.exit(f"only {len(starts)} forwards in the profile (embed_kernel launches); asked for step {a.step}")
    seq = rows[starts[a.step - 1]:starts[a.step]]
    total = sum(us for _, _, us in seq)
    print(f"### One forward (number {a.step} of {len(starts)} profiled): {len(seq)} kernels, {total:.1f} µs of kernel time\n")
    print("| # | kernel | µs |\n|---|---|---|")
    for i, (_, n, us) in enumerate(seq):
        print(f"| {i} | {short(n)} | {us:.2f} |")
    agg = collections.defaultdict(lambda: [0, 0.0])
    for _, n, us in seq:
        agg[short(n)][0] += 1
        agg[short(n)][1] += us
    print("\n| kernel | launches | µs | share |\n|---|---|---|---|")
    for n, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"| {n} | {c} | {us:.1f} | {100 * us / total:.1f} % |")


if __name__ == "__main__":
    main()
