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
//   bench_mla [--quick] [--only decode,prefill]
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla.h"
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

void bench_decode(bool quick, Timer& tm, cuda::GemmLt& lt) {
  const auto& d = kDims;
  const int64_t Bmax = 64, Ksel = 2048;
  cuda::DeviceBuffer q(size_t(Bmax * d.Hm * d.qk()) * 2), kvb(size_t(d.Hm * (d.N + d.Dv) * d.C) * 2),
      o(size_t(Bmax * d.Hm * d.Dv) * 2);
  fill_bf16(q.data(), size_t(Bmax * d.Hm * d.qk()), 1);
  fill_bf16(kvb.data(), size_t(d.Hm * (d.N + d.Dv) * d.C), 2);
  for (kestrel::LatentFormat lf : {kestrel::LatentFormat::bf16, kestrel::LatentFormat::fp8}) {
    LatentPool pool(lf, int64_t(4) << 20);  // 4M tokens: 4.8 GB BF16, 2.8 GB FP8 (> 2M read per step)
    const int64_t tb = pool.c.latent_token_bytes();
    header(fmt::format("MLA decode over paged {} latent ({} B/token), 12 heads, pages of 128", 
                       lf == kestrel::LatentFormat::bf16 ? "BF16" : "FP8", tb));
    for (bool sparse : {false, true}) {
      for (int64_t S : {int64_t(4096), int64_t(32768)}) {
        for (int64_t B : {int64_t(1), int64_t(8), int64_t(64)}) {
          std::mt19937 r(uint32_t(B * 131 + S));
          const auto tables = pool.tables(B, S, r);
          std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(S)), sel, scratch;
          if (sparse)
            for (int64_t b = 0; b < B; ++b) random_selection(S, Ksel, Ksel, r, scratch, sel);
          auto dt = upload(tables), dl = upload(lens), ds = upload(sel);
          cuda::PagedMlaCache c = pool.c;
          c.block_tables = static_cast<int32_t*>(dt.data()), c.bt_stride = (S + kP - 1) / kP;
          cuda::MlaPagedBatch bt;
          bt.lens = static_cast<int32_t*>(dl.data()), bt.sel = sparse ? static_cast<int32_t*>(ds.data()) : nullptr;
          bt.Ksel = Ksel, bt.B = B;
          const int64_t keys = sparse ? Ksel : S;
          bt.max_keys = keys;
          const double bytes = double(B) * keys * (double(tb) + 4.0 / kP + (sparse ? 4.0 : 0.0));
          const double flops = double(B) * d.Hm * keys * (2.0 * d.cw() + 2.0 * d.C);
          const int reps = quick ? 5 : (double(B) * keys * tb > 1e9 ? 20 : 50);
          const std::string shape = fmt::format("B={} S={}{}", B, S, sparse ? " top-2048" : "");
          auto* qp = static_cast<uint16_t*>(q.data());
          auto* kp = static_cast<uint16_t*>(kvb.data());
          auto* op = static_cast<uint16_t*>(o.data());
          {
            cuda::DeviceBuffer ws(cuda::mla_decode_paged_workspace_bytes(d, B, keys));
            const double us = tm.median_us(
                [&] { cuda::mla_decode_paged(lt, d, qp, kp, c, bt, ws.data(), op, nullptr); }, 3, reps);
            row("mla_decode_paged (tensor cores)", shape, us, bytes, flops);
            // The attention core alone (no q̃ GEMM, no merge + W_UV): what the split-KV kernel streams.
            const cuda::tc::Plan pl = cuda::tc::plan(B, keys);
            cuda::DeviceBuffer qt(size_t(B * d.Hm * d.C) * 4), ml(size_t(B * pl.n_splits * d.Hm) * 8),
                acc(size_t(B * pl.n_splits * d.Hm * d.C) * 4);
            KCUDA_CHECK(cudaMemset(qt.data(), 0, qt.size()));
            cuda::tc::Args a;
            a.d = d, a.cache = &c, a.lens = bt.lens, a.sel = bt.sel, a.Ksel = Ksel, a.B = B, a.plan = pl;
            a.qt = static_cast<float*>(qt.data()), a.q = qp;
            a.part_ml = static_cast<float*>(ml.data()), a.part_acc = static_cast<float*>(acc.data());
            const double us_core = tm.median_us([&] { cuda::tc::attend(a, nullptr); }, 3, reps);
            row(fmt::format("  attention core ({} splits of {} keys)", pl.n_splits, pl.chunk), shape, us_core, bytes,
                flops);
          }
          {
            cuda::DeviceBuffer ws(cuda::mla_decode_paged_simple_workspace_bytes(d, B, keys));
            const double us = tm.median_us(
                [&] { cuda::mla_decode_paged_simple(lt, d, qp, kp, c, bt, ws.data(), op, nullptr); }, 1,
                std::max(3, reps / 4));
            row("mla_decode_paged_simple (CUDA cores)", shape, us, bytes, flops);
          }
        }
      }
    }
  }
}

void bench_prefill(bool quick, Timer& tm, cuda::GemmLt& lt) {
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
    LatentPool pool(lf, int64_t(1) << 20);
    const int64_t tb = pool.c.latent_token_bytes();
    header(fmt::format("MLA prefill of an 8K-token chunk over paged {} latent, 12 heads",
                       lf == kestrel::LatentFormat::bf16 ? "BF16" : "FP8"));
    for (int64_t pos0 : {int64_t(0), int64_t(24576)}) {
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
        // Before: gather the context, expand [k_nope | v] through kv_b, naive attention per row.
        if (S <= cuda::mla_naive_max_keys()) {
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
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
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
    if (want("decode")) bench_decode(quick, tm, lt);
    if (want("prefill")) bench_prefill(quick, tm, lt);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
