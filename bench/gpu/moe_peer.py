"""PyTorch peer of bench/gpu/bench_moe.cpp: the routed-expert step of MODEL.md §3.6 (steps 3-4) at the real K3.1
shape (896 experts, top-16, latent Lt 3584, intermediate I 3072) with the experts held in BF16 (59 GB: what the
MXFP4 experts dequantise to), timed the way bench_moe times cuda::moe_experts_mxfp4.

One step: slots sorted by expert (stable argsort, counts by scatter_add: no host sync), the tokens' z gathered,
[g | u] = torch._grouped_mm(z, [W1; W3]ᵀ) in one grouped GEMM, a = bf16(SiTU-GLU(g, u)) in FP32,
y = torch._grouped_mm(a, W2ᵀ), ũ = bf16(Σ_k w_k·y_k) by index_add_ in FP32. Eight routings (16 distinct random
experts per token, weights 1/16) rotate call to call; CUDA events around each call, median; eager and replayed as
a CUDA graph. GB/s counts the BF16 bytes of the experts hit (66 MB each). `--per-expert` uses one matmul per hit
expert instead (host loop, eager only), also the fallback when torch._grouped_mm is missing.

    python3 bench/gpu/moe_peer.py [--batches 1,8,64,256,4096] [--reps N] [--per-expert] [--perf]

--perf: the scoreboard only (T = 1, 8, 64, 256; well under 90 s): lines `PERF moe_peer_torch_us_b<T> <µs>`, the
graph-replay time (eager where capture fails).
"""
from __future__ import annotations

import argparse
import statistics

import torch

X, K, LT, I = 896, 16, 3584, 3072
BETA, LBETA = 4.0, 25.0
SETS = 8


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * (LBETA * torch.tanh(u / LBETA))).to(torch.bfloat16)


def step_grouped(z, ids, w, w13, w2):
    T = z.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.zeros(X, dtype=torch.int32, device=z.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = z.index_select(0, tok)
    gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).float()
    a = situ_glu(gu[:, :I], gu[:, I:])
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros(T, LT, dtype=torch.float32, device=z.device)
    out.index_add_(0, tok, y.float() * w.reshape(-1).index_select(0, order).unsqueeze(1))
    return out.to(torch.bfloat16)


def step_per_expert(z, ids, w, w13, w2):
    out = torch.zeros(z.shape[0], LT, dtype=torch.float32, device=z.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = (z[tok] @ w13[e].t()).float()
        a = situ_glu(gu[:, :I], gu[:, I:])
        y = (a @ w2[e].t()).float()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
    return out.to(torch.bfloat16)


def median_us(fn, warm: int, reps: int) -> float:
    for i in range(warm):
        fn(i)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for i in range(reps):
        a.record()
        fn(warm + i)
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256,4096")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per point (default 50, 20 for T >= 1024)")
    ap.add_argument("--per-expert", action="store_true")
    ap.add_argument("--perf", action="store_true", help="PERF lines for T = 1, 8, 64, 256 only")
    args = ap.parse_args()
    if args.perf:
        args.batches, args.reps, args.per_expert = "1,8,64,256", args.reps or 20, False
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.empty(X, 2 * I, LT, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    w2 = torch.empty(X, LT, I, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    step = step_per_expert if args.per_expert else step_grouped
    how = "per-expert matmul" if args.per_expert else "torch._grouped_mm"
    if not args.per_expert:
        try:
            zt = torch.randn(4, LT, device=dev).to(torch.bfloat16)
            it = torch.stack([torch.randperm(X, device=dev)[:K] for _ in range(4)])
            step(zt, it, torch.full((4, K), 1.0 / K, device=dev), w13, w2)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report and fall back
            print(f"torch._grouped_mm failed ({type(e).__name__}: {e}); falling back to per-expert matmul")
            step, how = step_per_expert, "per-expert matmul (fallback)"
    expert_bytes = (2 * I * LT + LT * I) * 2
    print(f"## PyTorch peer ({torch.__version__}, {torch.cuda.get_device_name()}): {how}, BF16 experts "
          f"({expert_bytes / 1e6:.1f} MB each, {X * expert_bytes / 1e9:.1f} GB)\n")
    print("| T | experts hit | BF16 bytes | eager µs | graph µs | GB/s (best) |\n|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(14)
    for T in [int(b) for b in args.batches.split(",")]:
        sets = []
        for s in range(SETS):
            ids = torch.stack([torch.randperm(X, generator=g)[:K] for _ in range(T)]).to(dev)
            z = (torch.randn(T, LT, generator=g) * 0.5).to(torch.bfloat16).to(dev)
            sets.append((z, ids, torch.full((T, K), 1.0 / K, device=dev)))
        hit = statistics.mean(int(torch.unique(s[1]).numel()) for s in sets)
        reps = args.reps or (20 if T >= 1024 else 50)
        eager = median_us(lambda i: step(*sets[i % SETS], w13, w2), 3, reps)
        graph = float("nan")
        if step is step_grouped:
            try:
                graphs = []
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    for s in range(SETS):  # warm the allocator on the side stream first
                        step(*sets[s], w13, w2)
                torch.cuda.synchronize()
                for s in range(SETS):
                    gr = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gr):
                        step(*sets[s], w13, w2)
                    graphs.append(gr)
                graph = median_us(lambda i: graphs[i % SETS].replay(), 3, reps)
                del graphs
            except Exception as e:  # noqa: BLE001 - eager numbers still stand
                print(f"(T={T}: CUDA graph capture failed: {type(e).__name__}: {e})")
        best = min(eager, graph) if graph == graph else eager
        print(f"| {T} | {hit:.0f} | {hit * expert_bytes:.3g} | {eager:.1f} | {graph:.1f} | "
              f"{hit * expert_bytes / best / 1e3:.0f} |", flush=True)
        if args.perf:
            print(f"PERF moe_peer_torch_us_b{T} {graph if graph == graph else eager:.1f}", flush=True)


if __name__ == "__main__":
    main()
