"""`kestrel serve --speculative-config` (DSpark, docs/speculative.md) end to end on nano with its random draft
(reference/make_draft.py): through the official openai client, greedy completions of several concurrent requests
equal, token for token, the same requests served without speculation (a request asking for logprobs is served
without it: one server gives both); /metrics reports vLLM's spec_decode counters, and `kestrel bench` prints the
acceptance length from them."""
import concurrent.futures
import json
import re
import subprocess
import sys

import openai
import pytest

from conftest import ROOT, run_kestrel
from serve_util import Server

MODEL = "nano"
PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1 2 3 4 5 6"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nano-dspark") / "draft"
    subprocess.run([sys.executable, str(ROOT / "reference" / "make_draft.py"), "--config", "nano", "--out", str(out),
                    "--seed", "1"], check=True)
    return out


def completions(server, logprobs=None, max_tokens=10):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def one(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=logprobs)
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrent: batched verification
        return list(ex.map(one, PROMPTS))


def spec_counter(server, name):
    m, _ = server.metrics()
    return sum(v for k, v in m.items() if k.startswith(name + "_total"))


def test_greedy_speculation_equals_plain_and_reports_acceptance(kestrel_bin, nano_dir, draft_dir, tmp_path):
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4})
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", "4",
               "--block-size", "16", "--speculative-config", spec)
    try:
        plain = completions(s, logprobs=1)  # logprobs: served without speculation
        assert spec_counter(s, "vllm:spec_decode_num_drafts") == 0
        assert completions(s) == plain
        drafts = spec_counter(s, "vllm:spec_decode_num_drafts")
        draft_tokens = spec_counter(s, "vllm:spec_decode_num_draft_tokens")
        accepted = spec_counter(s, "vllm:spec_decode_num_accepted_tokens")
        assert drafts > 0 and 0 <= accepted <= draft_tokens <= 4 * drafts
        out = tmp_path / "r.json"
        p = run_kestrel(kestrel_bin, "bench", "--base-url", s.url, "--model", MODEL, "--tokenizer", nano_dir,
                        "--input-len", 16, "--output-len", 8, "--num-prompts", 2, "--max-concurrency", 2,
                        "--ignore-eos", "--no-progress", "--result-file", out, timeout=120)
        assert p.returncode == 0, p.stderr
        m = re.search(r"Acceptance length:\s+([\d.]+)", p.stdout)
        assert m, p.stdout
        r = json.loads(out.read_text())
        assert r["spec_decode_num_drafts"] > 0
        assert float(m.group(1)) == pytest.approx(1 + r["spec_decode_accepted_tokens"] / r["spec_decode_num_drafts"],
                                                  abs=0.01)
        # The run's share only (the bench's readiness probe before it also speculated).
        assert spec_counter(s, "vllm:spec_decode_num_drafts") >= drafts + r["spec_decode_num_drafts"]
    finally:
        assert s.stop() == 0


def test_generate_prints_acceptance_and_equals_plain(kestrel_bin, nano_dir, draft_dir, tmp_path):
    """`kestrel generate --speculative-config` (what k3data/spec_eval.py measures with): the same greedy tokens
    as without speculation, and a `speculative:` line whose acceptance length is 1 + accepted / drafts."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("ids:5,9,13,200,7\nids:1,2,3\n")
    args = ["generate", "--model", nano_dir, "--prompts-file", prompts, "--max-tokens", 12, "--temperature", 0]
    plain = run_kestrel(kestrel_bin, *args)
    spec = run_kestrel(kestrel_bin, *args, "--speculative-config",
                       json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4}))
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    toks = lambda out: re.findall(r"^\[\d\] tokens: (.*)$", out, re.M)  # noqa: E731
    assert len(toks(plain.stdout)) == 2 and toks(spec.stdout) == toks(plain.stdout)
    assert "speculative:" not in plain.stdout
    m = re.search(r"^speculative: (\d+) drafts, (\d+) draft tokens, (\d+) accepted; acceptance length ([\d.]+)$",
                  spec.stdout, re.M)
    assert m, spec.stdout
    drafts, draft_tokens, accepted, length = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert drafts > 0 and 0 <= accepted <= draft_tokens <= 4 * drafts
    assert length == pytest.approx(1 + accepted / drafts, abs=1e-3)
