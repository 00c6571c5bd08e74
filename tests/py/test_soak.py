"""CPU memory soak (issue #24): `kestrel serve` (the real CPU engine) under `kestrel bench --soak`, rounds
of concurrent streams with 30 % of the clients leaving early (half soon after the response head, while
queued; half mid-stream). After every round the server must drain, its engine's bookkeeping must pass the
integrity check (`--debug-routes`: GET /debug/integrity) with no page held, every stream must have ended
properly (a finish_reason and [DONE], or the client's own disconnect: the bench counts anything else as
broken and fails), and the server's memory must plateau after warm-up (the first rounds: connection
buffers, allocator arenas, the engine's step buffers): RSS within 8 MB (the issue's bound) and the heap
within a bound per request that a leak of 100 bytes per request fails (test 1's comment has the numbers).

1. Plain load on k3-tiny (models/k3-tiny, the shipped trained model; issue #24 point 3): 10 rounds of 250
   requests, 2–6-token prompts and 8 output tokens, completions endpoint (the chat template alone is ~46
   prompt tokens per request). The number of requests, not their length, is what a per-request leak
   scales with. 15–22 s on this 2-core box (quiet, and with two CPU hogs beside it).
2. Shared prefixes and a page pool too small for the running requests (16-token pages, 32-token prefill
   chunks; issue #24 point 4): prefix-cache hits, checkpoints, LRU eviction and preemption all happen, and
   after the drain every page is free or the prefix cache's. On the nano checkpoint (random weights; the
   pytest session makes it), whose small pages let 26 of them fit a 1.5 MB budget (6–9 s). Its heap is
   not bounded: 48 requests after round 2 are too few for a per-request bound, and what the prefix
   cache holds changes from round to round.

Other runs by environment: KESTREL_SOAK_MODEL=DIR another checkpoint for test 1; KESTREL_SOAK_ENDPOINT=
/v1/chat/completions the chat endpoint (the K3 output parser per stream) for test 1;
KESTREL_SOAK_PREFIX_MODEL=DIR another checkpoint for test 2 (models/k3-tiny needs KESTREL_SOAK_BUDGET=5220K
for the same 26 pages: its pages and KDA states are bigger). The GPU version, 10 rounds × 1,000 streams
on k3-tiny, is `bench/gpu/run.sh soak`."""
import json
import os
import pathlib

import pytest

from conftest import run_kestrel
from serve_util import Server

NAME = "soak"
ENDPOINT = os.environ.get("KESTREL_SOAK_ENDPOINT", "/v1/completions")
BUDGET = os.environ.get("KESTREL_SOAK_BUDGET", "1500K")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir():
    return pathlib.Path(os.environ.get("KESTREL_SOAK_MODEL", ROOT / "models" / "k3-tiny"))


@pytest.fixture(scope="module")
def model_dir(nano_dir):
    return pathlib.Path(os.environ.get("KESTREL_SOAK_PREFIX_MODEL", nano_dir))


def soak(kestrel_bin, server, model_dir, out, *args, baseline=2, timeout=600):
    p = run_kestrel(kestrel_bin, "bench", "--base-url", server.url, "--model", NAME, "--tokenizer", model_dir,
                    "--server-pid", server.proc.pid, "--no-progress", "--ready-check-timeout", 30,
                    "--soak-settle", 0.3, "--soak-baseline-round", baseline, "--soak-max-rss-growth", 8,
                    "--result-file", out, *args, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text()), p.stdout


def integrity(server):
    import urllib.request
    with urllib.request.urlopen(server.url + "/debug/integrity", timeout=10) as resp:
        return json.loads(resp.read())


def metric(server, name, **labels):
    """The sum of a metric's series whose labels include `labels`."""
    m, _ = server.metrics()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def check_rounds(r, streams, rounds, baseline=2):
    rs = r["rounds"]
    assert [x["round"] for x in rs] == list(range(rounds + 1))
    for x in rs[1:]:
        # Every stream ended properly: a finish (here always "length": --ignore-eos, no stop strings) or
        # the client leaving; none failed, none broke off.
        assert x["sent"] == streams and x["failed"] == 0 and x["broken"] == 0, x["first_error"]
        assert x["completed"] + x["dropped_queued"] + x["dropped_stream"] == streams
        assert x["finish_reasons"] == {"length": x["completed"]}, x["finish_reasons"]
        assert x["drained"], x
        assert x["integrity"] == "ok", x["integrity"]
        assert (x["running"], x["waiting"], x["kv_pages_used"]) == (0, 0, 0), x
        assert x["rss_mb"] is not None and x["rss_mb"] > 0
    # The clients did leave, both ways (about 15 % each).
    assert sum(x["dropped_queued"] for x in rs[1:]) >= streams * rounds * 0.05
    assert sum(x["dropped_stream"] for x in rs[1:]) >= streams * rounds * 0.05
    # RSS plateaus after warm-up: no round after the baseline is more than 8 MB above it.
    rss = [x["rss_mb"] for x in rs]
    b = baseline
    assert max(rss[b:]) - rss[b] <= 8, f"RSS grew after round {b} (MB per round): {rss}"
    assert r["ok"] and abs(r["rss_growth_mb"] - (rss[-1] - rss[b])) < 1e-6, r["verdict"]


def check_server_counts(s, r, total):
    """The server's own counters agree: each request (plus the bench's ready check) finished exactly once,
    by its length or as an abort, and it aborted no more than the clients that left."""
    done = sum(x["completed"] for x in r["rounds"])
    dropped = sum(x["dropped_queued"] + x["dropped_stream"] for x in r["rounds"])
    success = metric(s, "vllm:request_success_total")
    aborted = metric(s, "vllm:request_success_total", finished_reason="abort")
    assert success == total + 1, success
    assert metric(s, "vllm:request_success_total", finished_reason="length") + aborted == success
    # A client that leaves after its last token may still see its request finish by length.
    assert dropped * 0.5 <= aborted <= dropped, (aborted, dropped)
    assert metric(s, "vllm:request_success_total", finished_reason="length") >= done + 1


def test_soak_rss_flat(kestrel_bin, tiny_dir, tmp_path):
    # Why these sizes, and why the heap as well as RSS (measured on this 2-core box under other builds' load):
    # - 250 requests per round, 10 rounds, growth measured from after round 3: 1,750 requests are weighed.
    #   (5 rounds from round 2 failed CI once, at +83 bytes per request with no leak: that machine's warm-up
    #   was still settling in round 3, +44.6 KB in one round, and one allocation of ~15–20 KB that comes and
    #   goes between rounds landed in round 5; over 750 requests those two alone are 85 bytes each.)
    # - RSS (the bound, 8 MB) moves in pages and only once the allocator's free space is used up,
    #   so over 1,750 requests it can only fail for a leak of ≳ 8 MB / 1,750 ≈ 5 KB per request; it stays in
    #   as the operator's view, but it cannot see a small leak here. (Measured: +0.0–0.8 MB.)
    # - The heap (/debug/integrity's heap_bytes: glibc's mallinfo2, bytes handed out and not had back,
    #   exact to the byte) can. The server runs with glibc's per-thread cache off (tcache_count=0), whose
    #   up to 7 chunks per size class per thread count as in use and would add tens of KB of noise.
    #   Without a leak, rounds 3 to 10 moved +5.1 to +11.9 bytes per request (five runs; three 12- and
    #   10-round runs from round 2: +2.7, +10.6, +15.1): flat but for that 15–20 KB allocation. With a leak of
    #   100 bytes per request injected for the measurement (a malloc(100) per generation request in the
    #   route, not in the tree; a 112-byte chunk) it grew +122.7 and +125.4 bytes per request (two runs). The
    #   limit, 60 bytes per request (105 KB over the 1,750), is half the 100-byte leak and holds CI's bad
    #   case above (a late 45 KB warm-up step plus the 20 KB allocation: 37 bytes per request).
    # - 8 output tokens with --ignore-eos and queued drops within 20 ms: the batched engine finishes short
    #   streams before most clients get to leave, and the test must see them leave both ways.
    streams, rounds, base = 250, 10, 3
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    s = Server(kestrel_bin, tiny_dir, "--served-model-name", NAME, "--memory-budget", "48M", "--max-num-seqs", 32,
               "--max-queue", 4096, "--debug-routes", env=env)
    try:
        r, out = soak(kestrel_bin, s, tiny_dir, tmp_path / "soak.json", "--endpoint", ENDPOINT,
                      "--soak", rounds, "--num-prompts", streams, "--input-len", 4, "--range-ratio", 0.5,
                      "--output-len", 8, "--ignore-eos", "--seed", 3, "--soak-queued-drop-ms", 20,
                      "--soak-max-heap-growth", 60, baseline=base)
        print(out)
        check_rounds(r, streams, rounds, baseline=base)
        assert f"growth from round {base} to round {rounds}: RSS " in out
        heap = [x["heap_bytes"] for x in r["rounds"]]
        assert all(h is not None and h > 1e6 for h in heap), heap  # the server reported its heap every round
        assert r["requests_after_baseline"] == streams * (rounds - base)
        assert r["heap_bytes_per_request"] == pytest.approx((heap[-1] - heap[base]) / (streams * (rounds - base)))
        assert r["heap_bytes_per_request"] <= 60, f"heap grew after round {base} (bytes after each round): {heap}"
        done = integrity(s)
        assert done["requests"] == 0 and done["pages_held"] == 0
        assert done["pages_free"] + done["pages_cached"] == done["pages_total"]
        check_server_counts(s, r, streams * rounds)
    finally:
        assert s.stop() == 0


def test_soak_prefix_cache_and_preemption(kestrel_bin, model_dir, tmp_path):
    streams, rounds = 48, 3
    # 16-token pages, 26 of them (nano); 8 requests of ~110 prompt tokens (96 shared) admitted at once need ~50 pages
    # before the prefix cache holds their prefix, and 32-token prefill chunks make them grow page by page: the
    # newest get preempted.
    # All 8 prefill at once (the fairness defaults would let one long prompt prefill at a time, which never
    # over-commits the pool).
    s = Server(kestrel_bin, model_dir, "--served-model-name", NAME, "--memory-budget", BUDGET, "--block-size", 16,
               "--max-num-seqs", 8, "--max-num-batched-tokens", 32, "--max-num-partial-prefills", 8,
               "--max-long-partial-prefills", 8, "--max-queue", 4096, "--debug-routes")
    try:
        pages = integrity(s)["pages_total"]
        assert 16 <= pages <= 64, pages
        r, out = soak(kestrel_bin, s, model_dir, tmp_path / "soak.json", "--endpoint", "/v1/completions",
                      "--soak", rounds, "--num-prompts", streams, "--input-len", 16, "--range-ratio", 0.5,
                      "--output-len", 4, "--ignore-eos", "--soak-prefix-len", 96, "--soak-prefix-groups", 3,
                      "--seed", 4)
        print(out)
        check_rounds(r, streams, rounds)
        check_server_counts(s, r, streams * rounds)
        assert metric(s, "vllm:num_preemptions_total") > 0
        assert metric(s, "vllm:prefix_cache_hits_total") >= 64 * streams  # most requests skip their shared prefix
        done = integrity(s)
        assert (done["requests"], done["running"], done["waiting"], done["pages_held"]) == (0, 0, 0, 0), done
        # Every page is free or the prefix cache's, every state slot free or a checkpoint.
        assert done["pages_free"] + done["pages_cached"] == done["pages_total"] == pages, done
        assert done["slots_free"] + done["checkpoints"] == done["slots_total"], done
        assert metric(s, "kestrel:kv_pages_allocated") == done["pages_cached"]
        assert all(x["kv_pages_allocated"] <= pages for x in r["rounds"])
    finally:
        assert s.stop() == 0
