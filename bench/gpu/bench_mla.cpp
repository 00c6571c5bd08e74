// MLA attention over paged latent caches on the GPU (kernels/cuda/paged.h), at one TP8 rank's K3 shape
// (12 heads, C 512, R 64, N 128, Dv 128, pages of 128 tokens, block tables over a shuffled page pool):
//  - decode: mla_decode_paged (tensor cores, mla_tc.cu) and its attention core alone, next to the CUDA-core
//    mla_decode_paged_simple, at B = 1, 8, 64 and S = 4K, 32K, BF16 and FP8 pages, dense and top-2048;
//  - prefill: mla_prefill_paged over an 8K-token chunk (context 8K from position 0, and the last 8K of a
//    32K context), dense causal and indexer-sparse (top-2048), next to the gather + naive form it replaces.
// Each line: median of timed repetitions (CUDA events, after warm-ups), the cache bytes the op must read
// (key rows × bytes per token, plus the block-table and selection lookups), GB/s and its share of a
// device-to-device copy measured in the same run (read + write counted, as ANCHORS.md quotes it), and
// for the prefill the useful FLOPs (real heads only) as TFLOP/s. Inputs are random (never zeros).
//
//   bench_mla [--quick] [--only decode,prefill]   the tables
//   bench_mla --breakdown    each launch of the decode alone (q̃, core, merge + W_UV), with and without
//                            programmatic dependent launch; the core of one row under forced split plans
//   bench_mla --perf         the scoreboard's shapes only (≤ 60 s), as `PERF <key> <value>` lines:
//                            mla_decode_us_b64_s32k_{bf16,fp8}, mla_decode_pct_copy_b64_s32k (BF16; _fp8 too),
//                            mla_decode_us_b1_s4k, mla_prefill_us_8k_top2048
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_ref.h"  // tests/gpu/ref: the reference kernels (baselines)
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla_tc.h"
#include "kernels/cuda/paged.h"

using namespace kestrel;

namespace {

constexpr int kP = 128;
const cpu::MlaDims kDims{12, 128, 64, 128, 512};

// bf16 values of random sign and magnitude in [2^-3, 2^1), filled on the host in pieces.
void fill_bf16(void* d, size_t n, uint64_t seed) {
  std::vector<uint16_t> h(std::min<size_t>(n, size_t(32) << 20));
  std::mt19937_64 r(seed);
  for (size_t off = 0; off < n; off += h.size()) {
    const size_t m = std::min(h.size(), n - off);
    for (size_t i = 0; i < m; ++i) {
      const uint64_t z = r();
      h[i] = uint16_t(((z & 1) << 15) | ((124 + (z >> 1) % 4) << 7) | ((z >> 8) & 0x7f));
    }
    KCUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(d) + off, h.data(), m * 2, cudaMemcpyHostToDevice));
  }
}
template <typename T>
cuda::DeviceBuffer upload(const std::vector<T>& v) {
  cuda::DeviceBuffer b(std::max<size_t>(1, v.size()) * sizeof(T));
  if (!v.empty()) KCUDA_CHECK(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    KCUDA_CHECK(cudaEventCreate(&a));
    KCUDA_CHECK(cudaEventCreate(&b));
  }
  double median_us(const std::function<void()>& fn, int warm, int reps) {
    for (int i = 0; i < warm; ++i) fn();
    KCUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      KCUDA_CHECK(cudaEventRecord(a));
      fn();
      KCUDA_CHECK(cudaEventRecord(b));
      KCUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.0);
    }
    KCUDA_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

double g_copy = 0;  // GB/s of a device-to-device copy, read + write counted

void header(const std::string& title) {
  fmt::print("\n### {}\n\n| op | shape | µs | cache GB | GB/s | % of copy | GFLOP | TFLOP/s |\n|---|---|---|---|---|---|---|---|\n",
             title);
}
void row(const std::string& op, const std::string& shape, double us, double bytes, double flops) {
  const double gbs = bytes / us / 1e3;
  fmt::print("| {} | {} | {:.1f} | {:.3f} | {:.0f} | {:.0f}% | {:.3g} | {} |\n", op, shape, us, bytes / 1e9, gbs,
             100 * gbs / g_copy, flops / 1e9, flops > 0 ? fmt::format("{:.0f}", flops / us / 1e6) : "—");
  std::fflush(stdout);
}

// A latent pool of `tokens` tokens in one format, every token written through the cache writer (FP8 pages
// carry real scales).
struct LatentPool {
  cuda::PagedMlaCache c;
  cuda::DeviceBuffer arena;
  int64_t pages = 0;
  LatentPool(kestrel::LatentFormat lf, int64_t tokens) {
    c.latent_format = lf, c.block_size = kP, c.C = kDims.C, c.R = kDims.R;
    pages = tokens / kP;
    arena = cuda::DeviceBuffer(size_t(pages * kP * c.latent_token_bytes()));
    c.latent = static_cast<uint8_t*>(arena.data());
    const int64_t chunk = 65536;
    cuda::DeviceBuffer rows(size_t(chunk * kDims.cw()) * 2), slots(size_t(chunk) * 8);
    fill_bf16(rows.data(), size_t(chunk * kDims.cw()), 7);
    std::vector<int64_t> hs(static_cast<size_t>(chunk));
    for (int64_t off = 0; off < pages * kP; off += chunk) {
      const int64_t n = std::min(chunk, pages * kP - off);
      std::iota(hs.begin(), hs.end(), off);
      KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), size_t(n) * 8, cudaMemcpyHostToDevice));
      cuda::paged_write_latent(c, static_cast<uint16_t*>(rows.data()), kDims.cw(), static_cast<int64_t*>(slots.data()),
                               n, nullptr);
    }
    KCUDA_CHECK(cudaDeviceSynchronize());
  }
  // B requests of S tokens each: block tables over a random permutation of the pool's pages (wrapping
  // when B·S exceeds the pool).
  std::vector<int32_t> tables(int64_t B, int64_t S, std::mt19937& r) const {
    const int64_t nb = (S + kP - 1) / kP;
    std::vector<int32_t> perm(static_cast<size_t>(pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), r);
    std::vector<int32_t> t(static_cast<size_t>(B * nb));
    for (int64_t i = 0; i < B * nb; ++i) t[size_t(i)] = perm[size_t(i % pages)];
    return t;
  }
};

// `count` distinct sorted positions below `visible` (all of them when count ≥ visible), −1 padded to Ksel.
void random_selection(int64_t visible, int64_t count, int64_t Ksel, std::mt19937& r, std::vector<int32_t>& scratch,
                      std::vector<int32_t>& out) {
  const int64_t n = std::min(visible, count);
  scratch.resize(size_t(visible));
  std::iota(scratch.begin(), scratch.end(), 0);
  for (int64_t i = 0; i < n; ++i) std::swap(scratch[size_t(i)], scratch[size_t(i + int64_t(r() % uint32_t(visible - i)))]);
  std::sort(scratch.begin(), scratch.begin() + n);
  out.insert(out.end(), scratch.begin(), scratch.begin() + n);
  out.insert(out.end(), size_t(Ksel - n), -1);
}

// One decode batch on the device: B rows of S tokens each (block tables over the pool), dense or top-2048.
struct DecodeCase {
  cuda::DeviceBuffer dt, dl, ds;
  cuda::PagedMlaCache c;
  cuda::MlaPagedBatch bt;
  int64_t B, S, keys;
  bool sparse;
  double bytes, flops;
  DecodeCase(const LatentPool& pool, int64_t B_, int64_t S_, bool sparse_) : B(B_), S(S_), sparse(sparse_) {
    const auto& d = kDims;
    const int64_t Ksel = 2048;
    std::mt19937 r(uint32_t(B * 131 + S));
    const auto tables = pool.tables(B, S, r);
    std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(S)), sel, scratch;
    if (sparse)
      for (int64_t b = 0; b < B; ++b) random_selection(S, Ksel, Ksel, r, scratch, sel);
    dt = upload(tables), dl = upload(lens), ds = upload(sel);
    c = pool.c;
    c.block_tables = static_cast<int32_t*>(dt.data()), c.bt_stride = (S + kP - 1) / kP;
    bt.lens = static_cast<int32_t*>(dl.data()), bt.sel = sparse ? static_cast<int32_t*>(ds.data()) : nullptr;
    bt.Ksel = Ksel, bt.B = B;
    keys = sparse ? Ksel : S;
    bt.max_keys = keys;
    const double tb = double(pool.c.latent_token_bytes());
    bytes = double(B) * keys * (tb + 4.0 / kP + (sparse ? 4.0 : 0.0));
    flops = double(B) * d.Hm * keys * (2.0 * d.cw() + 2.0 * d.C);
  }
  std::string shape() const { return fmt::format("B={} S={}{}", B, S, sparse ? " top-2048" : ""); }
};

// Decode inputs shared by every case: q bf16 [64, Hm, N+R], kv_b, o.
struct DecodeIo {
  cuda::DeviceBuffer q, kvb, o;
  DecodeIo() {
    const auto& d = kDims;
    const int64_t Bmax = 64;
    q = cuda::DeviceBuffer(size_t(Bmax * d.Hm * d.qk()) * 2), kvb = cuda::DeviceBuffer(size_t(d.Hm * (d.N + d.Dv) * d.C) * 2);
    o = cuda::DeviceBuffer(size_t(Bmax * d.Hm * d.Dv) * 2);
    fill_bf16(q.data(), size_t(Bmax * d.Hm * d.qk()), 1);
    fill_bf16(kvb.data(), size_t(d.Hm * (d.N + d.Dv) * d.C), 2);
  }
  uint16_t* qp() { return static_cast<uint16_t*>(q.data()); }
  uint16_t* kp() { return static_cast<uint16_t*>(kvb.data()); }
  uint16_t* op() { return static_cast<uint16_t*>(o.data()); }
};

double time_decode(Timer& tm, cuda::GemmLt& lt, DecodeIo& io, const DecodeCase& k, int reps) {
  cuda::DeviceBuffer ws(cuda::mla_decode_paged_workspace_bytes(kDims, k.B, k.keys));
  return tm.median_us([&] { cuda::mla_decode_paged(lt, kDims, io.qp(), io.kp(), k.c, k.bt, ws.data(), io.op(), nullptr); },
                      3, reps);
}

const char* lf_name(kestrel::LatentFormat lf) { return lf == kestrel::LatentFormat::bf16 ? "BF16" : "FP8"; }

void bench_decode(bool quick, Timer& tm, cuda::GemmLt& lt) {
  const auto& d = kDims;
  DecodeIo io;
  for (kestrel::LatentFormat lf : {kestrel::LatentFormat::bf16, kestrel::LatentFormat::fp8}) {
    LatentPool pool(lf, int64_t(4) << 20);  // 4M tokens: 4.8 GB BF16, 2.8 GB FP8 (> 2M read per step)
    header(fmt::format("MLA decode over paged {} latent ({} B/token), 12 heads, pages of 128", lf_name(lf),
                       pool.c.latent_token_bytes()));
    for (bool sparse : {false, true}) {
      for (int64_t S : {int64_t(4096), int64_t(32768)}) {
        for (int64_t B : {int64_t(1), int64_t(8), int64_t(64)}) {
          const DecodeCase k(pool, B, S, sparse);
          const int reps = quick ? 5 : (k.bytes > 1e9 ? 20 : 50);
          row("mla_decode_paged (tensor cores)", k.shape(), time_decode(tm, lt, io, k, reps), k.bytes, k.flops);
          // The attention core alone (no q̃, no merge + W_UV): what the split-KV kernel streams.
          const cuda::tc::Plan pl = cuda::tc::plan(B, k.keys);
          cuda::DeviceBuffer qt(size_t(B * d.Hm * d.C) * 4), ml(size_t(B * pl.n_splits * d.Hm) * 8),
              acc(size_t(B * pl.n_splits * d.Hm * d.C) * 4);
          KCUDA_CHECK(cudaMemset(qt.data(), 0, qt.size()));
          cuda::tc::Args a;
          a.d = d, a.cache = &k.c, a.lens = k.bt.lens, a.sel = k.bt.sel, a.Ksel = k.bt.Ksel, a.B = B, a.plan = pl;
          a.qt = static_cast<float*>(qt.data()), a.q = io.qp();
          a.part_ml = static_cast<float*>(ml.data()), a.part_acc = static_cast<float*>(acc.data());
          const double us_core = tm.median_us([&] { cuda::tc::attend(a, nullptr); }, 3, reps);
          row(fmt::format("  attention core ({} splits of {} keys)", pl.n_splits, pl.chunk), k.shape(), us_core, k.bytes,
              k.flops);
          cuda::DeviceBuffer ws(cuda::mla_decode_paged_simple_workspace_bytes(d, B, k.keys));
          const double us = tm.median_us(
              [&] { cuda::mla_decode_paged_simple(lt, d, io.qp(), io.kp(), k.c, k.bt, ws.data(), io.op(), nullptr); }, 1,
              std::max(3, reps / 4));
          row("mla_decode_paged_simple (CUDA cores)", k.shape(), us, k.bytes, k.flops);
        }
      }
    }
  }
}

// --breakdown: every launch of the decode timed alone (q̃ on CUDA cores and by cuBLASLt, the core, the merge +
// W_UV), their sum, and the whole call with and without programmatic dependent launch; then the core of one
// row under forced split plans (the per-CTA fixed cost against the per-tile cost), and the core with no keys
// at all (launch + prologue + empty epilogue).
void bench_breakdown(Timer& tm, cuda::GemmLt& lt) {
  const auto& d = kDims;
  DecodeIo io;
  for (kestrel::LatentFormat lf : {kestrel::LatentFormat::bf16, kestrel::LatentFormat::fp8}) {
    LatentPool pool(lf, int64_t(4) << 20);
    fmt::print("\n### Decode launches one by one, paged {} latent (µs, median of 50)\n\n"
               "| shape | plan | q̃ CUDA cores | q̃ cuBLASLt | core | merge + W_UV | sum | call (PDL) | call (no PDL) |\n"
               "|---|---|---|---|---|---|---|---|---|\n",
               lf_name(lf));
    for (bool sparse : {false, true})
      for (int64_t S : {int64_t(4096), int64_t(32768)})
        for (int64_t B : {int64_t(1), int64_t(8), int64_t(64)}) {
          const DecodeCase k(pool, B, S, sparse);
          const int reps = k.bytes > 1e9 ? 20 : 50;
          const cuda::tc::Plan pl = cuda::tc::plan(B, k.keys);
          cuda::DeviceBuffer qt(size_t(B * d.Hm * d.C) * 4), ml(size_t(B * pl.n_splits * d.Hm) * 8),
              acc(size_t(B * pl.n_splits * d.Hm * d.C) * 4);
          auto* qtp = static_cast<float*>(qt.data());
          const double t_cc =
              tm.median_us([&] { cuda::tc::absorb_cuda_cores(d, io.qp(), io.kp(), qtp, B, nullptr, false); }, 3, reps);
          const int64_t C = d.C, QK = d.qk();
          const double t_lt = tm.median_us(
              [&] {
                lt.batched_xw_f32(io.qp(), d.Hm * QK, QK, io.kp(), C, (d.N + d.Dv) * C, qtp, d.Hm * C, C, B, d.N, C,
                                  d.Hm, nullptr);
              },
              3, reps);
          cuda::tc::Args a;
          a.d = d, a.cache = &k.c, a.lens = k.bt.lens, a.sel = k.bt.sel, a.Ksel = k.bt.Ksel, a.B = B, a.plan = pl;
          a.qt = qtp, a.q = io.qp(), a.part_ml = static_cast<float*>(ml.data()), a.part_acc = static_cast<float*>(acc.data());
          const double t_core = tm.median_us([&] { cuda::tc::attend(a, nullptr); }, 3, reps);
          const double t_merge = tm.median_us(
              [&] { cuda::tc::merge_uv(d, B, pl.n_splits, a.part_ml, a.part_acc, io.kp(), io.op(), nullptr, false); }, 3,
              reps);
          cuda::tc::set_pdl(true);
          const double t_pdl = time_decode(tm, lt, io, k, reps);
          cuda::tc::set_pdl(false);
          const double t_nopdl = time_decode(tm, lt, io, k, reps);
          cuda::tc::set_pdl(true);
          const double t_abs = B <= cuda::tc::kAbsorbMaxRows ? t_cc : t_lt;
          fmt::print("| {} | {} × {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n", k.shape(),
                     pl.n_splits, pl.chunk, t_cc, t_lt, t_core, t_merge, t_abs + t_core + t_merge, t_pdl, t_nopdl);
          std::fflush(stdout);
        }
    fmt::print("\n### Core of one row under forced split plans, paged {} latent (µs)\n\n| S | splits × keys | core |\n|---|---|---|\n",
               lf_name(lf));
    for (int64_t S : {int64_t(4096), int64_t(32768)}) {
      const DecodeCase k(pool, 1, S, false);
      const int64_t tiles = S / cuda::tc::kKeysPerTile;
      for (int64_t n = 1; n <= std::min<int64_t>(tiles, cuda::tc::kMaxSplits); n *= 2) {
        cuda::tc::Plan pl;
        pl.chunk = int((tiles + n - 1) / n * cuda::tc::kKeysPerTile), pl.n_splits = int(n);
        cuda::DeviceBuffer qt(size_t(d.Hm * d.C) * 4), ml(size_t(n * d.Hm) * 8), acc(size_t(n * d.Hm * d.C) * 4);
        KCUDA_CHECK(cudaMemset(qt.data(), 0, qt.size()));
        cuda::tc::Args a;
        a.d = d, a.cache = &k.c, a.lens = k.bt.lens, a.B = 1, a.plan = pl, a.qt = static_cast<float*>(qt.data()), a.q = io.qp();
        a.part_ml = static_cast<float*>(ml.data()), a.part_acc = static_cast<float*>(acc.data());
        fmt::print("| {} | {} × {} | {:.1f} |\n", S, n, pl.chunk, tm.median_us([&] { cuda::tc::attend(a, nullptr); }, 3, 50));
      }
    }
    {
      const DecodeCase k(pool, 64, 64, false);
      const std::vector<int32_t> zeros(64, 0), ones(64, 64);
      auto dz = upload(zeros), d64 = upload(ones);
      cuda::DeviceBuffer qt(size_t(64 * d.Hm * d.C) * 4), ml(size_t(64 * d.Hm) * 8), acc(size_t(64 * d.Hm * d.C) * 4);
      KCUDA_CHECK(cudaMemset(qt.data(), 0, qt.size()));
      for (int64_t B : {int64_t(1), int64_t(64)})
        for (const auto* lens : {&dz, &d64}) {
          cuda::tc::Args a;
          a.d = d, a.cache = &k.c, a.lens = static_cast<int32_t*>(lens->data()), a.B = B, a.qt = static_cast<float*>(qt.data());
          a.q = io.qp(), a.part_ml = static_cast<float*>(ml.data()), a.part_acc = static_cast<float*>(acc.data());
          fmt::print("| core, B={} rows of {} keys (one CTA each) | 1 × 64 | {:.1f} |\n", B, lens == &dz ? 0 : 64,
                     tm.median_us([&] { cuda::tc::attend(a, nullptr); }, 3, 50));
        }
    }
  }
}

// --perf: the scoreboard's decode numbers (PERF lines, bench/gpu/perf.py): B = 64 S = 32K over BF16 and FP8
// pages, B = 1 S = 4K over BF16 pages, whole calls.
void bench_perf_decode(Timer& tm, cuda::GemmLt& lt) {
  DecodeIo io;
  for (kestrel::LatentFormat lf : {kestrel::LatentFormat::bf16, kestrel::LatentFormat::fp8}) {
    LatentPool pool(lf, int64_t(4) << 20);
    const bool bf16 = lf == kestrel::LatentFormat::bf16;
    header(fmt::format("MLA decode over paged {} latent ({} B/token), 12 heads, pages of 128", lf_name(lf),
                       pool.c.latent_token_bytes()));
    const DecodeCase k(pool, 64, 32768, false);
    const double us = time_decode(tm, lt, io, k, 20);
    row("mla_decode_paged (tensor cores)", k.shape(), us, k.bytes, k.flops);
    const double pct = 100.0 * k.bytes / us / 1e3 / g_copy;
    fmt::print("PERF mla_decode_us_b64_s32k_{} {:.1f}\n", bf16 ? "bf16" : "fp8", us);
    fmt::print("PERF mla_decode_pct_copy_b64_s32k{} {:.1f}\n", bf16 ? "" : "_fp8", pct);
    if (bf16) {
      const DecodeCase k1(pool, 1, 4096, false);
      const double us1 = time_decode(tm, lt, io, k1, 50);
      row("mla_decode_paged (tensor cores)", k1.shape(), us1, k1.bytes, k1.flops);
      fmt::print("PERF mla_decode_us_b1_s4k {:.1f}\n", us1);
    }
    std::fflush(stdout);
  }
}

// The 8K-token prefill chunk at 0 and at 24576, dense and top-2048, BF16 and FP8 pages, next to the gather +
// naive form it replaced; --perf: only BF16 top-2048 at 0 (PERF mla_prefill_us_8k_top2048).
void bench_prefill(bool quick, bool perf, Timer& tm, cuda::GemmLt& lt) {
  const auto& d = kDims;
  const int64_t T = 8192, Ksel = 2048;
  cuda::DeviceBuffer q(size_t(T * d.Hm * d.qk()) * 2), kvb(size_t(d.Hm * (d.N + d.Dv) * d.C) * 2),
      o(size_t(T * d.Hm * d.Dv) * 2);
  fill_bf16(q.data(), size_t(T * d.Hm * d.qk()), 3);
  fill_bf16(kvb.data(), size_t(d.Hm * (d.N + d.Dv) * d.C), 4);
  auto* qp = static_cast<uint16_t*>(q.data());
  auto* kp = static_cast<uint16_t*>(kvb.data());
  auto* op = static_cast<uint16_t*>(o.data());
  for (kestrel::LatentFormat lf : {kestrel::LatentFormat::bf16, kestrel::LatentFormat::fp8}) {
    if (perf && lf != kestrel::LatentFormat::bf16) continue;
    LatentPool pool(lf, int64_t(1) << 20);
    const int64_t tb = pool.c.latent_token_bytes();
    header(fmt::format("MLA prefill of an 8K-token chunk over paged {} latent, 12 heads",
                       lf == kestrel::LatentFormat::bf16 ? "BF16" : "FP8"));
    for (int64_t pos0 : {int64_t(0), int64_t(24576)}) {
      if (perf && pos0 != 0) continue;
      const int64_t S = pos0 + T;
      std::mt19937 r(static_cast<uint32_t>(S));
      const auto tables = pool.tables(1, S, r);
      auto dt = upload(tables);
      cuda::PagedMlaCache c = pool.c;
      c.block_tables = static_cast<int32_t*>(dt.data()), c.bt_stride = (S + kP - 1) / kP;
      std::vector<int32_t> lens(static_cast<size_t>(T)), req(static_cast<size_t>(T), 0);
      for (int64_t t = 0; t < T; ++t) lens[size_t(t)] = int32_t(pos0 + t + 1);
      auto dl = upload(lens), dr = upload(req);
      for (bool sparse : {false, true}) {
        if (perf && !sparse) continue;
        std::vector<int32_t> sel, scratch;
        double key_rows = 0;
        for (int64_t t = 0; t < T; ++t) {
          if (sparse) random_selection(pos0 + t + 1, Ksel, Ksel, r, scratch, sel);
          key_rows += double(sparse ? std::min<int64_t>(pos0 + t + 1, Ksel) : pos0 + t + 1);
        }
        auto ds = upload(sel);
        cuda::MlaPagedBatch bt;
        bt.lens = static_cast<int32_t*>(dl.data()), bt.req = static_cast<int32_t*>(dr.data());
        bt.sel = sparse ? static_cast<int32_t*>(ds.data()) : nullptr, bt.Ksel = Ksel, bt.B = T;
        bt.max_keys = sparse ? Ksel : S;
        const double bytes = key_rows * double(tb);  // streamed into the SMs (mostly L2 hits)
        const double flops = key_rows * d.Hm * (2.0 * d.cw() + 2.0 * d.C) + double(T) * d.Hm * 2.0 * d.C * (d.N + d.Dv);
        const std::string shape = fmt::format("T=8192 at {}{}", pos0, sparse ? " top-2048" : " dense");
        cuda::DeviceBuffer ws(cuda::mla_prefill_paged_workspace_bytes(d, T, bt.max_keys));
        const double us = tm.median_us([&] { cuda::mla_prefill_paged(lt, d, qp, kp, c, bt, ws.data(), op, nullptr); },
                                       1, quick ? 3 : 10);
        row("mla_prefill_paged (tensor cores)", shape, us, bytes, flops);
        if (perf) fmt::print("PERF mla_prefill_us_8k_top2048 {:.1f}\n", us);
        // Before: gather the context, expand [k_nope | v] through kv_b, naive attention per row.
        if (!perf && S <= cuda::mla_naive_max_keys()) {
          std::vector<int32_t> prow(static_cast<size_t>(S));
          for (int64_t s = 0; s < S; ++s) prow[size_t(s)] = tables[size_t(s / kP)] * kP + int32_t(s % kP);
          auto dp = upload(prow);
          cuda::DeviceBuffer lat(size_t(S * d.cw()) * 2), kv(size_t(S * d.Hm * (d.N + d.Dv)) * 2);
          const double us_old = tm.median_us(
              [&] {
                cuda::paged_gather_latent(c, static_cast<int32_t*>(dp.data()), S, static_cast<uint16_t*>(lat.data()),
                                          nullptr);
                lt.bf16(static_cast<uint16_t*>(lat.data()), d.cw(), kp, static_cast<uint16_t*>(kv.data()),
                        d.Hm * (d.N + d.Dv), S, d.C, d.Hm * (d.N + d.Dv), nullptr);
                cuda::mla_attn_naive(d, qp, static_cast<uint16_t*>(kv.data()), static_cast<uint16_t*>(lat.data()),
                                     bt.sel, Ksel, T, pos0, op, nullptr);
              },
              1, 3);
          row("gather + kv_b expand + mla_attn_naive (before)", shape, us_old, bytes, flops);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, perf = false, breakdown = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--perf")) perf = true;
    else if (!std::strcmp(argv[i], "--breakdown")) breakdown = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      fmt::print(stderr, "usage: bench_mla [--quick] [--perf] [--breakdown] [--only decode,prefill]\n");
      return 2;
    }
  }
  auto want = [&](const char* s) { return only.empty() || only.find(s) != std::string::npos; };
  try {
    cudaDeviceProp prop{};
    KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    Timer tm;
    {
      const size_t n = size_t(2) << 30;
      cuda::DeviceBuffer a(n), b(n);
      KCUDA_CHECK(cudaMemset(a.data(), 1, n));
      const double us = tm.median_us([&] { KCUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice)); }, 2, 10);
      g_copy = 2.0 * double(n) / us / 1e3;
    }
    fmt::print("# bench_mla on {} ({} SMs): device-to-device copy {:.0f} GB/s (read + write)\n", prop.name,
               prop.multiProcessorCount, g_copy);
    cuda::GemmLt lt;
    if (perf) {
      if (want("decode")) bench_perf_decode(tm, lt);
      if (want("prefill")) bench_prefill(quick, true, tm, lt);
    } else if (breakdown) {
      bench_breakdown(tm, lt);
    } else {
      if (want("decode")) bench_decode(quick, tm, lt);
      if (want("prefill")) bench_prefill(quick, false, tm, lt);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
