#!/usr/bin/env python3
"""Long-context passkey through a running `kestrel serve` (issue #15 point 6: k3-tiny at 1,048,576 tokens).

Sends each item of a passkey set (JSONL, optionally .xz, as written by `train/k3data/make_eval.py`) as one streamed
chat request, one at a time, and reports per item the time to the first streamed token (the prefill of the whole
context, since the answer is a few tokens), the answer and whether its last integer is the pass key. Prints the
scoreboard lines `PERF passkey_1m_ok <1 if every item was answered, else 0>` and `PERF passkey_1m_prefill_s <median
seconds to the first token>` when --perf-prefix is passkey_1m (the default).

    passkey_long.py --base-url http://127.0.0.1:18123 --set sets1m/passkey-1m.jsonl.xz [--model k3-tiny]
"""
import argparse
import json
import lzma
import os
import statistics
import sys
import time
import urllib.request

# the eval sets' rule (`kestrel eval`, k3train.evaluate): the answer's last integer is the key, exactly — an
# answer that merely contains it ("340266" for 34026) is wrong
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train"))
from k3data.score import last_int_correct  # noqa: E402


def items(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def ask(base, model, item, timeout):
    body = dict(item["request"])
    body["stream"] = True
    if model:
        body["model"] = model
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                delta = ch.get("delta", {})
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if (piece or delta.get("tool_calls")) and first is None:
                    first = time.monotonic() - t0
                text.append(delta.get("content") or "")
    return first if first is not None else time.monotonic() - t0, "".join(text), time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--set", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--perf-prefix", default="passkey_1m")
    a = ap.parse_args()
    ok, ttfts = [], []
    for it in items(a.set):
        ttft, answer, total = ask(a.base_url.rstrip("/"), a.model, it, a.timeout)
        good = last_int_correct(answer, it["expect"]["answer"])
        ok.append(good)
        ttfts.append(ttft)
        print(f"{it['id']}: context {it['meta'].get('context_tokens')} depth {it['meta'].get('depth')}: "
              f"first token {ttft:.1f} s, total {total:.1f} s, answer {answer.strip()[:40]!r}, "
              f"expected {it['expect']['answer']}: {'OK' if good else 'MISS'}", flush=True)
    if ok:
        print(f"PERF {a.perf_prefix}_ok {1 if all(ok) else 0}")
        print(f"PERF {a.perf_prefix}_correct {sum(ok)}")
        print(f"PERF {a.perf_prefix}_items {len(ok)}")
        print(f"PERF {a.perf_prefix}_prefill_s {statistics.median(ttfts):.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
