"""`--async-scheduling` (run-ahead, docs/serving.md) end to end on nano: `kestrel serve` with the flag answers
concurrent greedy and seeded completions with exactly the text of a server without it, its /metrics counts the
steps that ran ahead (0 without the flag), and `kestrel generate` prints the same tokens either way plus how many
steps ran ahead; the fake engine with a modelled device (--fake-step-us) does the same, and charges --fake-token-us per token."""
import concurrent.futures
import re
import time

import openai

from conftest import run_kestrel
from serve_util import Server

MODEL = "nano"
# (prompt, seed): None is greedy; the seeded ones sample at temperature 0.9 with top-p 0.9.
CASES = [("The quick brown fox", None), ("Once upon a time in a land", 7), ("1 2 3 4 5 6", 11),
         ("A longer prompt, so that the requests differ in length from the start", None)]


def completions(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def one(case):
        prompt, seed = case
        sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "top_p": 0.9, "seed": seed}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **sampling)
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as ex:  # concurrent: batched decode steps
        return list(ex.map(one, CASES))


def ahead_steps(server):
    m, _ = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("kestrel:ahead_steps_total"))


def serve(kestrel_bin, nano_dir, *flags):
    return Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs",
                  "4", "--block-size", "16", *flags)


def test_serve_with_async_scheduling_answers_as_without(kestrel_bin, nano_dir):
    s = serve(kestrel_bin, nano_dir)
    try:
        plain = completions(s)
        assert ahead_steps(s) == 0
    finally:
        assert s.stop() == 0
    s = serve(kestrel_bin, nano_dir, "--async-scheduling")
    try:
        assert completions(s) == plain
        assert ahead_steps(s) > 0
    finally:
        assert s.stop() == 0


def test_generate_with_async_scheduling_prints_the_same_tokens(kestrel_bin, nano_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("ids:5,9,13,200,7\nids:1,2,3\nids:40,41,42,43,44,45,46,47\n")
    args = ["generate", "--model", nano_dir, "--prompts-file", prompts, "--max-tokens", 14, "--temperature", 0.8,
            "--seed", 5]
    off = run_kestrel(kestrel_bin, *args)
    on = run_kestrel(kestrel_bin, *args, "--async-scheduling")
    assert off.returncode == 0, off.stderr
    assert on.returncode == 0, on.stderr
    tokens = lambda out: re.findall(r"^\[\d+\] tokens: .*$", out, re.M)
    assert len(tokens(off.stdout)) == 3
    assert tokens(on.stdout) == tokens(off.stdout)
    m = re.search(r"^async scheduling: (\d+) of (\d+) steps launched ahead", on.stdout, re.M)
    assert m, on.stdout
    assert 0 < int(m.group(1)) < int(m.group(2))
    assert "async scheduling" not in off.stdout


def test_fake_engine_with_a_modelled_device_runs_ahead(kestrel_bin, nano_dir):
    """`--fake-engine --fake-step-us N` (a modelled device, fake_executor.h; bench/engine_async_ab.sh): with
    --async-scheduling its steps run ahead, and its streams — random logits seeded by the prompt and the output
    index — are those of the same fake without the flag."""
    flags = ("--fake-engine", "--fake-step-us", "200")
    s = serve(kestrel_bin, nano_dir, *flags)
    try:
        plain = completions(s)
        assert ahead_steps(s) == 0
    finally:
        assert s.stop() == 0
    s = serve(kestrel_bin, nano_dir, *flags, "--async-scheduling")
    try:
        assert completions(s) == plain
        assert ahead_steps(s) > 0
    finally:
        assert s.stop() == 0


def test_fake_engine_models_a_cost_per_token(kestrel_bin, nano_dir):
    """`--fake-token-us T` adds T µs of modelled device time per token of a step: a prompt's prefill step takes at
    least its tokens × T (a lower bound — the fake waits for its modelled device), and the tokens are unchanged."""
    flags = ("--fake-engine", "--fake-step-us", "100")
    client = lambda s: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = " ".join(str(i) for i in range(60))
    out = {}
    for token_us in ("0", "400"):
        s = serve(kestrel_bin, nano_dir, *flags, "--fake-token-us", token_us)
        try:
            t0 = time.monotonic()
            r = client(s).completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
            out[token_us] = (time.monotonic() - t0, r.choices[0].text, r.usage.prompt_tokens)
        finally:
            assert s.stop() == 0
    (fast, text0, n), (slow, text1, _) = out["0"], out["400"]
    assert text0 == text1
    assert n >= 100 and slow >= n * 400e-6, (n, slow)
    assert slow > fast
