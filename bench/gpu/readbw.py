#!/usr/bin/env python3
"""Read rate of one launch by size, as PyTorch reaches it (a peer ceiling for the decode step's GEMVs).

The decode step's kernels each read 10-300 MB once; copy_gbps (bench_ops) is measured on large copies, so it
says nothing about what one launch of that size can reach. This times torch's fp32 sum (a pure read) and a
copy at each size, 20 launches captured in one CUDA graph and replayed, and prints GB/s per launch.
"""
import torch


def timed(fn, reps=20, iters=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / reps)
    best.sort()
    return best[len(best) // 2]


def main():
    print("device", torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    print("| MB | sum µs | sum GB/s | copy µs | copy GB/s (read+write) |")
    print("|---|---|---|---|---|")
    for mb in (8, 16, 32, 66, 128, 187, 280, 512, 1024, 4096):
        n = mb * (1 << 20) // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        us = timed(lambda: torch.sum(x))
        cus = timed(lambda: y.copy_(x))
        nb = n * 4
        print(f"| {mb} | {us:.1f} | {nb / us / 1e3:.0f} | {cus:.1f} | {2 * nb / cus / 1e3:.0f} |")
        del x, y


if __name__ == "__main__":
    main()
