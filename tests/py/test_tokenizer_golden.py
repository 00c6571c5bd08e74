"""Golden test: the C++ tokenizer must reproduce tiktoken exactly.

Generates the corpus (k3tok_corpus; >= 100,000 strings by default, KESTREL_GOLDEN_N to change),
encodes it with the Python reference (tiktoken + Moonshot's chunking rules, k3tok_reference) and
with `kestrel tokenize --jsonl` (binary from KESTREL_BIN, default build/src/cli/kestrel), and
requires identical ids for every string and decode(encode(x)) == x (x after invalid-UTF-8
replacement). The test vocabulary is tests/data/tok_golden (see tests/py/make_test_vocab.py).
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3tok_corpus  # noqa: E402
import k3tok_reference as R  # noqa: E402

N = int(os.environ.get("KESTREL_GOLDEN_N", "100000"))
BIN = os.environ.get("KESTREL_BIN", os.path.join(R.REPO, "build", "src", "cli", "kestrel"))


def run_kestrel(cases, model_dir):
    lines = []
    for c in cases:
        d = {"hex": c["raw"].hex()} if "raw" in c else {"text": c["text"]}
        if c["special"]:
            d["special"] = True
        lines.append(json.dumps(d, ensure_ascii=False))
    inp = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    assert os.path.exists(BIN), f"kestrel binary not found at {BIN} (set KESTREL_BIN)"
    res = subprocess.run([BIN, "tokenize", "--model", model_dir, "--jsonl"], input=inp, capture_output=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    out = [json.loads(l) for l in res.stdout.decode("utf-8").split("\n") if l]
    assert len(out) == len(cases)
    return out


def test_golden_tiktoken_identical():
    enc = R.load_encoding()
    vocab_strings = [enc.decode_single_token_bytes(i).decode("utf-8", "replace") for i in range(enc.n_vocab - 256)]
    cases = k3tok_corpus.golden_corpus(vocab_strings, N)
    got = run_kestrel(cases, R.GOLDEN_VOCAB_DIR)
    bad = []
    for i, (c, g) in enumerate(zip(cases, got)):
        src = c["raw"].decode("utf-8", "replace") if "raw" in c else c["text"]
        want = R.reference_encode(enc, src, c["special"])
        if g["ids"] != want or g["decoded"] != src or enc.decode(want) != src:
            bad.append((i, src[:200], want[:40], g["ids"][:40]))
    print(f"golden: {len(cases) - len(bad)}/{len(cases)} identical")
    assert not bad, f"{len(bad)} mismatches; first: {bad[:5]}"
    assert len(cases) >= N
