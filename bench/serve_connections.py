#!/usr/bin/env python3
"""How many concurrent SSE streams `kestrel serve` holds at once (a measurement, not a test).

Starts `kestrel serve --fake-engine` (no model: the engine emits a token per stream every
--delay-ms, so streams stay open for seconds), opens N streaming /v1/completions requests over raw
asyncio sockets, waits until every one of them has received its first chunk while all are still
open, samples the server's threads / RSS / CPU time from /proc, then reads every stream to its
[DONE]. Prints one JSON line.

  bench/serve_connections.py --kestrel build/src/cli/kestrel --model DIR [--streams 1200] [--tokens 200]
"""
import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import time


def proc_stats(pid):
    with open(f"/proc/{pid}/status") as f:
        st = f.read()
    threads = int(re.search(r"Threads:\s+(\d+)", st).group(1))
    rss_mb = int(re.search(r"VmRSS:\s+(\d+)", st).group(1)) / 1024
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"threads": threads, "rss_mb": round(rss_mb, 1), "cpu_s": round(cpu_s, 2), "fds": fds}


async def stream(host, port, body, first_seen, done):
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:60]
    data = b""
    seen = False
    while True:
        b = await reader.read(65536)
        if not b:
            break
        data += b
        if not seen and b"data: " in data:
            seen = True
            first_seen.append(time.time())
    writer.close()
    ok = b"data: [DONE]" in data
    done.append(ok)


async def main_async(a, host, port, pid):
    first_seen, done = [], []
    body = {"prompt": "x", "max_tokens": a.tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    t0 = time.time()
    tasks = [asyncio.create_task(stream(host, port, body, first_seen, done)) for _ in range(a.streams)]
    while len(first_seen) < a.streams and time.time() - t0 < 120:
        await asyncio.sleep(0.05)
    t_all_open = time.time() - t0
    peak = proc_stats(pid)
    open_now = len(first_seen) - len(done)
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": a.streams, "tokens_per_stream": a.tokens, "delay_ms": a.delay_ms,
            "all_streaming_after_s": round(t_all_open, 2), "open_simultaneously": open_now,
            "completed_with_done": sum(done), "total_s": round(time.time() - t0, 2),
            "server_at_peak": peak, "server_end": proc_stats(pid)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=1200)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--delay-ms", type=int, default=50)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    p = subprocess.Popen([a.kestrel, "serve", "--model", a.model, "--port", "0", "--fake-engine", "--fake-delay-ms",
                          str(a.delay_ms), "--max-num-seqs", str(a.streams), "--max-queue", str(a.streams)],
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        host, port = re.search(r"http://([\d.]+):(\d+)", line).groups()
        time.sleep(0.5)
        res = asyncio.run(main_async(a, host, int(port), p.pid))
        print(json.dumps(res))
    finally:
        p.terminate()
        p.wait(timeout=30)


if __name__ == "__main__":
    main()
