#!/usr/bin/env python3
"""Per-replay kernel timeline of CUDA graphs from bench/gpu/kernel_trace.cpp's CSV.

    CUDA_INJECTION64_PATH=.../libkestrel_kernel_trace.so KESTREL_TRACE_OUT=trace.csv bench_ops --perf --only model ...
    python3 bench/gpu/timeline.py trace.csv [--graph ID] [--replay median|N]

A replay is the kernels of one graph launch (same graph id and launch correlation id). For every graph with at
least --min-kernels kernels: replays, kernels per replay, median wall time (first kernel start to last end).
Then, for the chosen graph (default: every listed one) and its median replay: each kernel in start order with its
start offset, duration, the gap to the latest end before it (negative: it overlapped the kernels before, e.g.
under programmatic dependent launch) and its exposed time (the part of it no earlier kernel covers); idle time
is where no kernel of the replay runs. wall = Σ exposed + idle. Last, exposed and busy time per kernel name.

    python3 bench/gpu/timeline.py A.csv B.csv [...] [--labels a,b,...]

With several traces (runs of the same program under different settings, e.g. bench/gpu/run.sh timeline_ab): for
each graph of the first trace, the median replay's wall time and each kernel name's exposed time side by side,
one column per trace, and each later trace's difference from the first.
"""
import argparse
import collections
import csv
import statistics
import sys


def load(path):
    reps = collections.defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            g = int(r["graph"])
            if g == 0:
                continue
            reps[(g, int(r["corr"]))].append(
                (int(r["start_ns"]), int(r["end_ns"]), r["name"], r["grid"], int(r["graph_node"])))
    for k in reps:
        reps[k].sort()
    return reps


def analyse(ks):
    t0 = ks[0][0]
    rows, cover_end, idle = [], None, 0
    for s, e, name, grid, _ in ks:
        gap = None if cover_end is None else (s - cover_end)
        if cover_end is None:
            exposed = e - s
        else:
            if s > cover_end:
                idle += s - cover_end
            exposed = max(0, e - max(s, cover_end))
        cover_end = e if cover_end is None else max(cover_end, e)
        rows.append((name, grid, (s - t0) / 1e3, (e - s) / 1e3, None if gap is None else gap / 1e3, exposed / 1e3))
    wall = (cover_end - t0) / 1e3
    return rows, wall, idle / 1e3


def median_replay(rs):
    order = sorted(range(len(rs)), key=lambda i: analyse(rs[i])[1])
    return order[len(order) // 2]


def graphs_of(path, min_kernels):
    by_graph = collections.defaultdict(list)
    for (g, c), ks in sorted(load(path).items(), key=lambda kv: kv[1][0][0]):
        by_graph[g].append(ks)
    return {g: rs for g, rs in sorted(by_graph.items()) if statistics.median(len(r) for r in rs) >= min_kernels}


def compare(paths, labels, min_kernels):
    traces = [graphs_of(p, min_kernels) for p in paths]
    for g, rs0 in traces[0].items():
        cols = []  # per trace: (wall, idle, {name: [launches, exposed]}) of the median replay, or None
        for t in traces:
            rs = t.get(g)
            if not rs:
                cols.append(None)
                continue
            rows, wall, idle = analyse(rs[median_replay(rs)])
            agg = collections.OrderedDict()
            for name, _, _, _, _, exp in rows:
                c = agg.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += exp
            cols.append((wall, idle, agg))
        head = " | ".join(labels) + "".join(f" | Δ {l}" for l in labels[1:])
        print(f"\n### graph {g}: median replay of each trace, exposed µs\n")
        print(f"| kernel | launches | {head} |\n|---|---|" + "---|" * (2 * len(labels) - 1))
        names = list(cols[0][2].keys())
        for c in cols[1:]:
            if c:
                names += [n for n in c[2] if n not in names]
        base = cols[0][2]
        names.sort(key=lambda n: -base.get(n, [0, 0.0])[1])

        def cells(value_of):
            vals = [value_of(c) if c else None for c in cols]
            out = [("—" if v is None else f"{v:.1f}") for v in vals]
            out += [("—" if v is None or vals[0] is None else f"{v - vals[0]:+.1f}") for v in vals[1:]]
            return " | ".join(out)

        for n in names:
            launches = "/".join(str(c[2][n][0]) if c and n in c[2] else "0" for c in cols)
            print(f"| {n} | {launches} | {cells(lambda c: c[2][n][1] if n in c[2] else 0.0)} |")
        print(f"| (idle) | | {cells(lambda c: c[1])} |")
        print(f"| **wall** | | {cells(lambda c: c[0])} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--labels", help="comma-separated column names for several traces (default: the file names)")
    ap.add_argument("--graph", type=int, action="append", help="graph id(s) to detail (default: all listed)")
    ap.add_argument("--min-kernels", type=int, default=10)
    ap.add_argument("--replay", default="median", help="'median' (by wall time) or an index among the graph's replays")
    a = ap.parse_args()
    if len(a.csv) > 1:
        labels = a.labels.split(",") if a.labels else [p.rsplit("/", 1)[-1] for p in a.csv]
        if len(labels) != len(a.csv):
            ap.error(f"{len(labels)} labels for {len(a.csv)} traces")
        compare(a.csv, labels, a.min_kernels)
        return 0
    reps = load(a.csv[0])
    by_graph = collections.defaultdict(list)
    for (g, c), ks in sorted(reps.items(), key=lambda kv: kv[1][0][0]):
        by_graph[g].append(ks)
    listed = []
    print("| graph | replays | kernels | median wall µs | min | max |\n|---|---|---|---|---|---|")
    for g, rs in sorted(by_graph.items()):
        n = statistics.median(len(r) for r in rs)
        if n < a.min_kernels:
            continue
        walls = [analyse(r)[1] for r in rs]
        print(f"| {g} | {len(rs)} | {int(n)} | {statistics.median(walls):.1f} | {min(walls):.1f} | {max(walls):.1f} |")
        listed.append(g)
    for g in a.graph or listed:
        rs = by_graph.get(g)
        if not rs:
            print(f"\ngraph {g}: no replays", file=sys.stderr)
            continue
        if a.replay == "median":
            pick = median_replay(rs)
        else:
            pick = int(a.replay)
        rows, wall, idle = analyse(rs[pick])
        busy = sum(r[3] for r in rows)
        print(f"\n### graph {g}, replay {pick} of {len(rs)}: {len(rows)} kernels, wall {wall:.1f} µs, "
              f"kernel time {busy:.1f} µs, idle {idle:.1f} µs\n")
        print("| # | kernel | grid | start µs | µs | gap µs | exposed µs |\n|---|---|---|---|---|---|---|")
        for i, (name, grid, st, dur, gap, exp) in enumerate(rows):
            gs = "" if gap is None else f"{gap:.2f}"
            print(f"| {i} | {name} | {grid} | {st:.2f} | {dur:.2f} | {gs} | {exp:.2f} |")
        agg = collections.OrderedDict()
        for name, _, _, dur, _, exp in rows:
            c = agg.setdefault(name, [0, 0.0, 0.0])
            c[0] += 1
            c[1] += dur
            c[2] += exp
        print("\n| kernel | launches | µs | exposed µs | exposed share of wall |\n|---|---|---|---|---|")
        for name, (n, dur, exp) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
            print(f"| {name} | {n} | {dur:.1f} | {exp:.1f} | {100 * exp / wall:.1f} % |")
        print(f"| (idle) | | | {idle:.1f} | {100 * idle / wall:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
