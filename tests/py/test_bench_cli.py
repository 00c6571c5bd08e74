"""`kestrel bench` against `kestrel serve --fake-engine` on loopback: the JSON result (counts, vLLM's
keys, sane orderings), exact prompt lengths as the server counts them, the chat endpoint with model
discovery and a paced request rate, and failures (nothing listening) reported rather than crashing."""
import json
import re
import socket

import pytest

from conftest import run_kestrel
from serve_util import Server

MODEL = "nano"


@pytest.fixture(scope="module")
def server(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--fake-delay-ms", "2", "--served-model-name", MODEL,
               "--max-model-len", "1024", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0


def prompt_tokens_total(server):
    m, _ = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("vllm:prompt_tokens_total"))


def check_result(r, n):
    assert r["completed"] == n and r["failed"] == 0 and r["num_prompts"] == n
    for k in ("duration", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
              "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"):
        assert k in r, k
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in r, (stat, metric)
        assert 0 < r[f"median_{metric}_ms"] <= r[f"p99_{metric}_ms"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["total_token_throughput"] > r["output_throughput"]
    # A request's end-to-end time covers its first token.
    assert r["median_e2el_ms"] >= r["median_ttft_ms"]


def test_completions_fixed_concurrency(kestrel_bin, nano_dir, server, tmp_path):
    out = tmp_path / "r.json"
    before = prompt_tokens_total(server)
    p = run_kestrel(kestrel_bin, "bench", "--base-url", server.url, "--model", MODEL, "--tokenizer", nano_dir,
                    "--input-len", 48, "--output-len", 8, "--num-prompts", 12, "--max-concurrency", 4,
                    "--num-warmups", 2, "--ignore-eos", "--seed", 5, "--no-progress", "--save-detailed",
                    "--result-file", out, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Serving Benchmark Result" in p.stdout and "Mean TPOT (ms):" in p.stdout
    assert re.search(r"Successful requests:\s+12\b", p.stdout)
    assert re.search(r"Maximum request concurrency:\s+4\b", p.stdout)
    assert "%|" not in p.stderr  # --no-progress
    r = json.loads(out.read_text())
    check_result(r, 12)
    assert r["max_concurrency"] == 4 and r["request_rate"] == "inf" and r["model_id"] == MODEL
    assert 1 <= r["max_concurrent_requests"] <= 4
    # Prompts are exactly 48 tokens as the server's tokenizer counts them: 12 measured requests,
    # 2 warm-ups and the initial test request.
    assert r["total_input_tokens"] == 12 * 48 and r["input_lens"] == [48] * 12
    assert prompt_tokens_total(server) - before == (12 + 2 + 1) * 48
    # --ignore-eos: every request generates all 8 tokens (counted from the server's usage).
    assert r["total_output_tokens"] == 12 * 8 and r["output_lens"] == [8] * 12
    assert all(len(itl) >= 1 for itl in r["itls"]) and all(e == "" for e in r["errors"])


def test_chat_paced_rate_and_model_discovery(kestrel_bin, nano_dir, server, tmp_path):
    out = tmp_path / "r.json"
    # No --model: taken from /v1/models; no --tokenizer: the model name is no directory, so random words.
    p = run_kestrel(kestrel_bin, "bench", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
                    "--input-len", 20, "--output-len", 6, "--range-ratio", 0.5, "--num-prompts", 10,
                    "--request-rate", 40, "--ignore-eos", "--metric-percentiles", "50,90,99",
                    "--result-file", out, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "model: nano (from /v1/models)" in p.stdout
    assert "Request rate configured (RPS):" in p.stdout and "P90 ITL (ms):" in p.stdout
    assert "no --tokenizer" in p.stderr
    assert "10/10" in p.stderr  # the progress bar ends complete
    r = json.loads(out.read_text())
    check_result(r, 10)
    assert r["endpoint_type"] == "openai-chat" and r["request_rate"] == 40 and r["max_concurrency"] is None
    assert r["p50_ttft_ms"] == pytest.approx(r["median_ttft_ms"])
    assert r["p90_itl_ms"] <= r["p99_itl_ms"]
    # Output lengths vary with --range-ratio in [3, 9]; usage counts them exactly.
    assert 10 * 3 <= r["total_output_tokens"] <= 10 * 9
    assert "input_lens" not in r  # only with --save-detailed, as vLLM


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_reported(kestrel_bin, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "r.json"
    # Without the readiness check every request runs and fails; the report is still written.
    p = run_kestrel(kestrel_bin, "bench", "--base-url", url, "--model", "m", "--input-len", 8, "--output-len", 4,
                    "--num-prompts", 5, "--max-concurrency", 2, "--ready-check-timeout", 0, "--no-progress",
                    "--result-file", out, timeout=30)
    assert p.returncode == 1
    assert "error: all 5 requests failed" in p.stderr and "refused" in p.stderr.lower()
    assert re.search(r"Failed requests:\s+5\b", p.stdout)
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 5 and r["mean_ttft_ms"] == 0
    assert r["error_samples"] and "refused" in r["error_samples"][0].lower()
    # With it (the default), a clear error at once.
    p = run_kestrel(kestrel_bin, "bench", "--base-url", url, "--model", "m", "--num-prompts", 2,
                    "--ready-check-timeout", 0.5, timeout=30)
    assert p.returncode == 1 and "initial test request" in p.stderr and "Serving Benchmark Result" not in p.stdout
    # And without --model, model discovery says what went wrong.
    p = run_kestrel(kestrel_bin, "bench", "--base-url", url, timeout=30)
    assert p.returncode == 1 and "cannot list the models" in p.stderr


def test_bad_arguments(kestrel_bin):
    for args, msg in ((["--preset", "1k-1k"], "--preset"), (["--request-rate", "fast"], "--request-rate"),
                      (["--base-url", "https://127.0.0.1:1"], "https"), (["--dataset", "sharegpt"], "random"),
                      (["--endpoint", "/v1/embeddings"], "--endpoint")):
        p = run_kestrel(kestrel_bin, "bench", "--model", "m", *args, timeout=30)
        assert p.returncode == 1 and msg in p.stderr, (args, p.stderr)


def test_dropped_keepalive_connections_are_retried(kestrel_bin, tmp_path):
    """A server that promises keep-alive but closes after every response (as one whose idle timeout
    has passed would): the reused connection fails before any answer and the request is sent again
    on a fresh one, instead of being counted as failed."""
    import threading

    body = "".join(f'data: {json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": f}]})}\n\n'
                   for t, f in (("a", None), ("b", None), ("c", "length")))
    body += 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}\n\ndata: [DONE]\n\n'
    response = (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(body)}\r\n"
                f"Connection: keep-alive\r\n\r\n{body}").encode()
    srv = socket.create_server(("127.0.0.1", 0))
    served = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                if head.startswith(b"GET "):  # bench reads /metrics around the run (speculation counters)
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    continue
                n = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
                while len(rest) < n:
                    rest += conn.recv(65536)
                conn.sendall(response)
                served.append(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    out = tmp_path / "r.json"
    try:
        p = run_kestrel(kestrel_bin, "bench", "--base-url", f"http://127.0.0.1:{srv.getsockname()[1]}", "--model", "m",
                        "--input-len", 3, "--output-len", 3, "--num-prompts", 6, "--max-concurrency", 1,
                        "--no-progress", "--result-file", out, timeout=30)
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 18
    assert len(served) == 7  # the test request and the six


def _metric(server, name):
    m, _ = server.metrics()
    return sum(v for k, v in m.items() if k.startswith(name))


def test_chat_itl_is_per_token_and_warmups_are_not_measured(kestrel_bin, nano_dir, tmp_path):
    # One request at a time, 20 ms per engine step: every token comes one step after the previous,
    # so the server's own inter-token latency is ~20 ms. Chat output of random tokens is full of
    # markup that produces no delta: counted per chunk the gaps merge; per token (usage in every
    # chunk) they match the server's.
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--fake-delay-ms", "20", "--served-model-name", MODEL,
               "--max-model-len", "2048", "--max-num-seqs", "1")
    try:
        itl0, n0 = _metric(s, "vllm:inter_token_latency_seconds_sum"), _metric(s, "vllm:inter_token_latency_seconds_count")
        out = tmp_path / "r.json"
        p = run_kestrel(kestrel_bin, "bench", "--base-url", s.url, "--endpoint", "/v1/chat/completions", "--model", MODEL,
                        "--tokenizer", nano_dir, "--input-len", 300, "--output-len", 30, "--num-prompts", 4,
                        "--max-concurrency", 1, "--num-warmups", 2, "--ignore-eos", "--save-detailed", "--no-progress",
                        "--result-file", out, timeout=120)
        assert p.returncode == 0, p.stderr
        r = json.loads(out.read_text())
        server_itl_ms = 1000 * (_metric(s, "vllm:inter_token_latency_seconds_sum") - itl0) / \
            (_metric(s, "vllm:inter_token_latency_seconds_count") - n0)
        assert r["total_output_tokens"] == 4 * 30
        # One ITL sample per token after each request's first chunk.
        assert sum(len(x) for x in r["itls"]) >= 4 * 30 - 4 * 3
        assert r["mean_itl_ms"] == pytest.approx(server_itl_ms, rel=0.25), (r["mean_itl_ms"], server_itl_ms)
        # The warm-ups (and the readiness probe) used prompts of their own: nothing the measured run
        # sent was served from the prefix cache.
        assert _metric(s, "vllm:prefix_cache_hits_total") == 0
    finally:
        assert s.stop() == 0
