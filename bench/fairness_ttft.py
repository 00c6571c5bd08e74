#!/usr/bin/env python3
"""Fairness measurement (issue #23, docs/serving.md "Fairness"): time to first token of short chat
requests sent while one long prompt is prefilling, and the long prompt's own time to first token.

    python3 bench/fairness_ttft.py --kestrel build/src/cli/kestrel [--long-tokens 19000] [--shorts 5]
        [--serve-args "--long-prefill-token-threshold 0"] [--model DIR] [--gap S] [--delay S]

Starts `kestrel serve` (the embedded k3-tiny unless --model), sends the long prompt (streamed,
max_tokens 1), then a one-word request every --gap seconds; prints each short TTFT and the long one."""
import argparse
import json
import re
import shlex
import subprocess
import threading
import time
import urllib.request


def stream_ttft(url, body, timeout=1800):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and '"role"' not in line:
                return time.time() - t0
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--long-tokens", type=int, default=19000)
    ap.add_argument("--shorts", type=int, default=5)
    ap.add_argument("--gap", type=float, default=3.0)
    ap.add_argument("--delay", type=float, default=2.0, help="seconds between the long prompt and the first short one")
    ap.add_argument("--serve-args", default="")
    a = ap.parse_args()
    cmd = [a.kestrel, "serve", "--port", "0", "--disable-access-log", "--max-model-len", str(max(65536, a.long_tokens + 8192)),
           *(["--model", a.model] if a.model else []), *shlex.split(a.serve_args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    for line in p.stdout:
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            url = m.group(1)
        if "ready" in line:
            break
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    try:
        toks = urllib.request.urlopen(urllib.request.Request(
            url + "/tokenize", data=json.dumps({"prompt": "The grass is green and the sky is blue. "}).encode(),
            headers={"Content-Type": "application/json"})).read()
        per = json.loads(toks)["count"]
        text = "The grass is green and the sky is blue. " * max(1, a.long_tokens // per)
        long_ttft = {}
        t_long = threading.Thread(target=lambda: long_ttft.update(s=stream_ttft(url, {
            "messages": [{"role": "user", "content": text}], "max_tokens": 1, "stream": True})))
        t_long.start()
        time.sleep(a.delay)
        shorts = []
        for _ in range(a.shorts):
            if not t_long.is_alive():
                break
            shorts.append(stream_ttft(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                            "stream": True, "reasoning_effort": "none"}))
            print(f"short request TTFT {shorts[-1]:.2f} s (long prompt still prefilling: {t_long.is_alive()})",
                  flush=True)
            time.sleep(a.gap)
        t_long.join()
        print(f"long prompt ({a.long_tokens} tokens) TTFT {long_ttft['s']:.1f} s; shorts: max {max(shorts):.2f} s, "
              f"mean {sum(shorts) / len(shorts):.2f} s over {len(shorts)}")
    finally:
        p.terminate()
        p.wait(timeout=30)


if __name__ == "__main__":
    main()
