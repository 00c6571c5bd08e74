#!/usr/bin/env python3
"""FLA's KDA kernels at the shapes of bench/gpu/bench_kda.cpp, for a same-run comparison on the GPU machine.

Prefill: fla.ops.kda.chunk_kda (Triton, chunk 64) at 12 heads x 128 for 8K, 32K, 128K tokens, 8 x 8K packed
(cu_seqlens), and 32K x 96 heads; q, k, v in BF16 (FLA's usual inputs), g and beta FP32, an FP32 initial
state and the final state returned, q/k already L2-normalised. `--safe-gate` adds the safe_gate=True variant
(gates bounded in [-5, 0)). Decode: fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd with one token per
request, the FP32 state pool updated in place through ssm_state_indices (as serving engines call it), at
batch 1, 8, 64, 256, 1024, rotating over slot sets of a pool larger than the L2; reported with the state
traffic (read + write of f32 [H, 128, 128] per request) in TB/s.

Timing: triton.testing.do_bench (median, L2 flushed between runs). FLA is carried as its pure-Python wheel
(fla-core 0.6.0; needs torch, triton, einops, which the GPU image has):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
  PYTHONPATH=/tmp/site python3 bench/gpu/kda_peer.py [--quick] [--only prefill|decode] [--safe-gate] [--perf]
--perf prints only the scoreboard lines (well under 60 s): PERF fla_chunk_kda_us_h12_32k <us>,
PERF fla_chunk_kda_us_h12_8k <us>, PERF fla_fused_recurrent_us_b1 <us> (FP32 state, in place).
"""
import argparse
import math

import torch
import torch.nn.functional as F
import triton

from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

DK = 128


def inputs(T, H, dtype, device="cuda", seed=0):
    """q, k unit-norm per head (q scaled by Dk^-1/2 via FLA's default scale), v, g = -5*sigmoid(z), beta in (0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, DK, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, H, DK, device=device, generator=gen), dim=-1).to(dtype)
    v = (torch.rand(1, T, H, DK, device=device, generator=gen) * 2 - 1).to(dtype)
    g = -5.0 * torch.sigmoid(3 * (torch.rand(1, T, H, DK, device=device, generator=gen) * 2 - 1))
    beta = 0.5 + 0.45 * (torch.rand(1, T, H, device=device, generator=gen) * 2 - 1)
    return q, k, v, g.float(), beta.float()


def ms(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def prefill_us(H, L, B, rep=100, **extra):
    """Median microseconds of one chunk_kda call at H heads, B sequences of L tokens."""
    T = L * B
    q, k, v, g, beta = inputs(T, H, torch.bfloat16)
    cu = torch.arange(0, T + 1, L, dtype=torch.long, device="cuda")
    h0 = torch.zeros(B, H, DK, DK, dtype=torch.float32, device="cuda")

    def f():
        chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **extra)

    with torch.inference_mode():
        return ms(f, rep=rep) * 1e3


def decode_us(B, H=12, rep=200):
    """Median microseconds of one fused_recurrent_kda_fwd step of B requests (one token each), FP32 state in
    place, rotating over slot sets of a pool larger than the L2."""
    per_slot = H * DK * DK * 4
    n_sets = max(2, math.ceil(2e9 / (B * per_slot)))
    pool = torch.zeros(n_sets * B, H, DK, DK, dtype=torch.float32, device="cuda")
    q, k, v, g, beta = inputs(B, H, torch.float32)
    cu = torch.arange(0, B + 1, dtype=torch.long, device="cuda")
    sets = [torch.arange(s * B, (s + 1) * B, dtype=torch.int32, device="cuda") for s in range(n_sets)]
    it = [0]

    def f():
        idx = sets[it[0] % n_sets]
        it[0] += 1
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                cu_seqlens=cu, ssm_state_indices=idx)

    with torch.inference_mode():
        t = ms(f, rep=rep) * 1e3
    del pool
    torch.cuda.empty_cache()
    return t


def perf():
    for L in (32768, 8192):
        print(f"PERF fla_chunk_kda_us_h12_{L // 1024}k {prefill_us(12, L, 1):.1f}", flush=True)
        torch.cuda.empty_cache()
    print(f"PERF fla_fused_recurrent_us_b1 {decode_us(1):.2f}", flush=True)


def prefill(quick, safe_gate):
    print("\n== FLA chunk_kda prefill (BF16 q/k/v, FP32 g/beta/state) ==")
    print(f"{'shape':<22} {'ms':>10} {'Mtok/s':>10}")
    cases = [(12, 8192, 1), (12, 32768, 1), (12, 131072, 1), (12, 8192, 8), (96, 32768, 1)]
    if quick:
        cases = cases[:2]
    for H, L, B in cases:
        variants = [("", {})] + ([(" safe_gate", {"safe_gate": True})] if safe_gate else [])
        for name, extra in variants:
            t = prefill_us(H, L, B, rep=100 if L * B <= 32768 else 300, **extra) / 1e3
            print(f"{f'H={H} {B}x{L}{name}':<22} {t:>10.3f} {L * B / t / 1e3:>10.1f}")
        torch.cuda.empty_cache()


def decode(quick):
    H = 12
    print(f"\n== FLA fused_recurrent_kda_fwd decode, in place, H={H}, Dk={DK}, FP32 state ==")
    print(f"{'B':>6} {'us':>10} {'TB/s':>10}")
    for B in ([1, 64] if quick else [1, 8, 64, 256, 1024]):
        t = decode_us(B, H)
        print(f"{B:>6} {t:>10.2f} {2 * B * H * DK * DK * 4 / (t * 1e-6) / 1e12:>10.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["prefill", "decode"])
    ap.add_argument("--safe-gate", action="store_true")
    ap.add_argument("--perf", action="store_true", help="only the PERF scoreboard lines")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if a.perf:
        perf()
        return
    if a.only in (None, "decode"):
        decode(a.quick)
    if a.only in (None, "prefill"):
        prefill(a.quick, a.safe_gate)


if __name__ == "__main__":
    main()
