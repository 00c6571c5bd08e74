"""bench/gpu/timeline.py on hand-made traces (the CSV that bench/gpu/kernel_trace.cpp writes): a replay's wall
time, idle time and each kernel's exposed time (the part of it no earlier kernel covers), and the side-by-side
comparison of several traces. Expected values are worked out by hand from the spans below."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "bench" / "gpu" / "timeline.py"
HEAD = "start_ns,end_ns,graph,graph_node,corr,stream,grid,block,name\n"


def trace(path, replays):
    """replays: [(corr, [(start_ns, end_ns, name), ...])], all of graph 7; plus one non-graph kernel (graph 0)."""
    lines = [HEAD, "0,500,0,0,1,1,1x1x1,32x1x1,eager_kernel\n"]
    for corr, ks in replays:
        for node, (s, e, name) in enumerate(ks):
            lines.append(f"{s},{e},7,{node},{corr},1,4x1x1,128x1x1,{name}\n")
    path.write_text("".join(lines))
    return str(path)


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *args, "--min-kernels", "2"], capture_output=True, text=True,
                          check=True).stdout


def row(out, name, section=0):
    """The cells of table row `name` in the section-th '### graph' part of the output."""
    part = out.split("### graph")[section + 1]
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in:\n{part}")


# One replay, µs: A 0–10; B 4–14 (starts under A: exposed 4); gap 14–16 (idle 2); C 16–20 (exposed 4);
# D 17–19 (inside C: exposed 0). Wall 20 = 10 + 4 + 4 + 0 + idle 2.
REPLAY = [(0, 10_000, "A"), (4_000, 14_000, "B"), (16_000, 20_000, "C"), (17_000, 19_000, "D")]


def shifted(ks, by_ns, stretch_c_ns=0):
    return [(s + by_ns, e + by_ns + (stretch_c_ns if n == "C" else 0), n) for s, e, n in ks]


def test_exposed_idle_and_wall(tmp_path):
    out = run(trace(tmp_path / "t.csv", [(11, REPLAY)]))
    assert "| 7 | 1 | 4 | 20.0 | 20.0 | 20.0 |" in out  # graph, replays, kernels, median / min / max wall
    assert "wall 20.0 µs, kernel time 26.0 µs, idle 2.0 µs" in out
    assert row(out, "A")[1:] == ["1", "10.0", "10.0", "50.0 %"]
    assert row(out, "B")[1:] == ["1", "10.0", "4.0", "20.0 %"]
    assert row(out, "C")[3] == "4.0" and row(out, "D")[3] == "0.0"
    assert row(out, "(idle)")[3] == "2.0"
    assert "eager_kernel" not in out  # kernels outside graphs are not replays


def test_median_replay_is_picked_by_wall(tmp_path):
    # Three replays of walls 20, 23 (C 3 µs longer) and 21 (C 1 µs longer): the median is the 21 µs one.
    t = trace(tmp_path / "t.csv", [(1, REPLAY), (2, shifted(REPLAY, 100_000, 3_000)), (3, shifted(REPLAY, 200_000, 1_000))])
    out = run(t)
    assert "| 7 | 3 | 4 | 21.0 | 20.0 | 23.0 |" in out
    assert "replay 2 of 3" in out and row(out, "C")[3] == "5.0"


def test_compare_puts_traces_side_by_side(tmp_path):
    a = trace(tmp_path / "a.csv", [(1, REPLAY)])
    b = trace(tmp_path / "b.csv", [(1, shifted(REPLAY, 0, 2_000))])  # C 2 µs longer: C +2, wall +2
    out = run(a, b, "--labels", "before,after")
    assert "| kernel | launches | before | after | Δ after |" in out
    assert row(out, "C") == ["C", "1/1", "4.0", "6.0", "+2.0"]
    assert row(out, "A") == ["A", "1/1", "10.0", "10.0", "+0.0"]
    assert row(out, "**wall**")[2:] == ["20.0", "22.0", "+2.0"]
    # A kernel only the second trace has: 0 launches and 0 µs in the first.
    c = trace(tmp_path / "c.csv", [(1, REPLAY + [(20_000, 21_000, "E")])])
    out = run(a, c, "--labels", "x,y")
    assert row(out, "E") == ["E", "0/1", "0.0", "1.0", "+1.0"]
