// Benchmark of the KDA delta-rule scans (kernels/cuda/kda.h) at one TP8 rank's K3.1 shape (12 heads × 128;
// also the full 96 heads for one prefill): the chunk-parallel prefill kda_chunked (explicit workspace, as
// the engine calls it) at 8K, 32K, 128K tokens, 8 × 8K packed, and 32K × 96 heads, next to FLA's
// chunk_kda measured on our H200 (ANCHORS.md; bench/gpu/kda_peer.py re-measures it in the same run); and
// decode (one token per request) through kda_decode and kda_recurrent at batch 1 .. 1024, FP32 and FP16
// state, with the state traffic (read + write of f32/f16 [H, 128, 128] per request) in TB/s.
//
// Prefill is also timed launch by launch (KdaChunkedVariant::launches): the intra-chunk launch of each
// variant (with the chunk table) and the sequential launch of each variant on the images the intra launch
// left, each with its HBM bytes and tensor-core FLOPs against the measured time; and the full call of the
// engine's variant (kda_chunked_default_variant: intra 2 + seq 3, the fastest TF32 pair measured,
// unless KESTREL_KDA_CHUNKED says otherwise) next to intra 2 + seq 2, intra 2 + seq 4 (clusters, multicast)
// and the same with the FP16 recurrence.
// Decode: every kernel (one block per work item, the same with an L2 prefetch one part-wave ahead, persistent
// blocks prefetching the next item's state into shared memory or registers), auto (blocks; prefetch past four
// waves) and the engine's (kda_decode_default_variant: auto unless KESTREL_KDA_DECODE).
//
// Timing: CUDA events around every launch, median of the repetitions after warm-ups; decode launches are queued
// before they run (median_us' hold), so each event pair times the kernel, not the host's launch rate. Decode rotates over
// disjoint slot sets of a state pool several times the L2, so every launch reads its states from HBM.
// Inputs are random (q, k unit-norm per head, q scaled by Dk^-1/2, g = −5·σ(z), β in (0, 1)), tiled from
// 4096 random rows for the long prefills.
//
//   bench_kda [--quick] [--only prefill|decode] [--perf [--variant INTRA,SEQ,F16]]
// --perf prints only PERF lines (≤ 60 s): the scoreboard's, for the engine's variants (or the kda_chunked
// variant given, e.g. --variant 2,4,1 = intra 2, seq 4, FP16 recurrence), FP32 state:
//   PERF kda_prefill_us_h12_32k <µs>   PERF kda_prefill_us_h12_8k <µs>
//   PERF kda_decode_us_b1 <µs>         PERF kda_decode_tbps_b1024 <TB/s>
// and the same for every variant, to rank them in one run (informative keys in perf.json):
//   PERF kda_prefill_us_h12_{32k,8k}_i<INTRA>s<SEQ>[h]   (h: FP16 recurrence) for i1s1 i2s1 i2s2 i2s3 i2s4 i2s2h
//                                                         i2s3h i2s4h
//   PERF kda_decode_us_b1_{blocks,stream,regs,pf}   PERF kda_decode_tbps_b1024_{blocks,stream,regs,pf}
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kda.h"

using namespace kestrel;

namespace {

constexpr int64_t kDk = 128;

// Median over `reps` launches of fn, each bracketed by its own pair of events. hold (the decode cases): the
// launches are queued behind a host function that blocks the stream until a batch of them is enqueued, so they
// run back to back on the device, as they do inside the engine's CUDA graphs. Without it a launch that takes
// a few µs measures the host's launch rate as well: the batch-1 decode read 5.1–5.5 µs on one machine start
// and 7.1–7.7 µs on another for every kernel alike (2026-12-02). The host function gives up after 200 ms,
// so a stream that cannot take a whole batch without blocking the host only loses the hold, never deadlocks.
struct Hold {
  std::atomic<int> go{0};
  static void CUDART_CB wait(void* p) {
    auto* h = static_cast<Hold*>(p);
    const auto t0 = std::chrono::steady_clock::now();
    while (h->go.load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200))
      std::this_thread::yield();
  }
};

double median_us(const std::function<void()>& fn, int warm, int reps, bool hold = false) {
  for (int i = 0; i < warm; ++i) fn();
  KCUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(size_t(2 * reps));
  for (auto& e : ev) KCUDA_CHECK(cudaEventCreate(&e));
  constexpr int kBatch = 50;  // launches per hold: 150 queued operations, well inside a stream's queue
  std::vector<std::unique_ptr<Hold>> holds;
  for (int i = 0; i < reps; ++i) {
    if (hold && i % kBatch == 0) {
      if (!holds.empty()) holds.back()->go.store(1, std::memory_order_release);
      holds.push_back(std::make_unique<Hold>());
      KCUDA_CHECK(cudaLaunchHostFunc(nullptr, Hold::wait, holds.back().get()));
    }
    KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * i)]));
    fn();
    KCUDA_CHECK(cudaEventRecord(ev[size_t(2 * i + 1)]));
  }
  if (!holds.empty()) holds.back()->go.store(1, std::memory_order_release);
  KCUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]));
    t[size_t(i)] = 1e3 * ms;
  }
  for (auto& e : ev) KCUDA_CHECK(cudaEventDestroy(e));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Scan inputs for T rows of H heads: q, k, v, g f32 [T, H*Dk], beta f32 [T, H]. The host makes R ≤ 4096
// random rows; the device copies them down the buffer.
struct Inputs {
  cuda::DeviceBuffer q, k, v, g, beta;
};
Inputs make_inputs(int64_t T, int64_t H, uint64_t seed) {
  const int64_t HD = H * kDk, R = std::min<int64_t>(T, 4096);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(size_t(R * HD)), k(size_t(R * HD)), v(size_t(R * HD)), g(size_t(R * HD)), beta(size_t(R * H));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      float* qr = &q[size_t(r * HD + h * kDk)];
      float* kr = &k[size_t(r * HD + h * kDk)];
      double sq = 0, sk = 0;
      for (int64_t i = 0; i < kDk; ++i) qr[i] = u(rng), kr[i] = u(rng), sq += qr[i] * qr[i], sk += kr[i] * kr[i];
      const float nq = float(1.0 / std::sqrt(sq * double(kDk))), nk = float(1.0 / std::sqrt(sk));
      for (int64_t i = 0; i < kDk; ++i) qr[i] *= nq, kr[i] *= nk;
      beta[size_t(r * H + h)] = 0.5f + 0.45f * u(rng);
    }
  for (auto& x : v) x = u(rng);
  for (auto& x : g) x = -5.0f / (1.0f + std::exp(-3.0f * u(rng)));
  Inputs in{cuda::DeviceBuffer(size_t(T * HD) * 4), cuda::DeviceBuffer(size_t(T * HD) * 4),
            cuda::DeviceBuffer(size_t(T * HD) * 4), cuda::DeviceBuffer(size_t(T * HD) * 4),
            cuda::DeviceBuffer(size_t(T * H) * 4)};
  auto tile = [&](const cuda::DeviceBuffer& d, const std::vector<float>& h, int64_t row) {
    const size_t piece = size_t(R * row) * 4;
    KCUDA_CHECK(cudaMemcpy(d.data(), h.data(), piece, cudaMemcpyHostToDevice));
    for (int64_t r0 = R; r0 < T; r0 += R)
      KCUDA_CHECK(cudaMemcpy(static_cast<char*>(d.data()) + size_t(r0 * row) * 4, d.data(),
                             size_t(std::min(R, T - r0) * row) * 4, cudaMemcpyDeviceToDevice));
  };
  tile(in.q, q, HD);
  tile(in.k, k, HD);
  tile(in.v, v, HD);
  tile(in.g, g, HD);
  tile(in.beta, beta, H);
  return in;
}

// One prefill shape on the device: inputs, cu_seqlens, slots, pool, output, workspace.
struct PrefillCase {
  int64_t H, L, B, T, HD;
  Inputs in;
  cuda::DeviceBuffer cu, slots, pool, o, ws;
  size_t ws_bytes;
  PrefillCase(int64_t H_, int64_t L_, int64_t B_)
      : H(H_), L(L_), B(B_), T(L_ * B_), HD(H_ * kDk), in(make_inputs(L_ * B_, H_, 7)),
        cu(size_t(B_ + 1) * 4), slots(size_t(B_) * 4), pool(size_t(B_ * H_ * kDk * kDk) * 4),
        o(size_t(L_ * B_ * H_ * kDk) * 4), ws(cuda::kda_chunked_workspace_bytes(L_ * B_, B_, H_, kDk)),
        ws_bytes(cuda::kda_chunked_workspace_bytes(L_ * B_, B_, H_, kDk)) {
    std::vector<int32_t> c(static_cast<size_t>(B + 1)), sl(static_cast<size_t>(B));
    for (int64_t b = 0; b <= B; ++b) c[size_t(b)] = int32_t(b * L);
    for (int64_t b = 0; b < B; ++b) sl[size_t(b)] = int32_t(b);
    cu.copy_from_host(c.data(), c.size() * 4);
    slots.copy_from_host(sl.data(), sl.size() * 4);
    KCUDA_CHECK(cudaMemset(pool.data(), 0, size_t(B * H * kDk * kDk) * 4));
  }
  void run(const cuda::KdaChunkedVariant& v) {
    cuda::kda_chunked(static_cast<float*>(in.q.data()), static_cast<float*>(in.k.data()),
                      static_cast<float*>(in.v.data()), static_cast<float*>(in.g.data()), HD,
                      static_cast<float*>(in.beta.data()), H, static_cast<int32_t*>(cu.data()),
                      static_cast<int32_t*>(slots.data()), static_cast<float*>(pool.data()),
                      static_cast<float*>(o.data()), T, B, H, kDk, ws.data(), nullptr, v);
  }
  double us(const cuda::KdaChunkedVariant& v, int reps) {
    return median_us([&] { run(v); }, 2, reps);
  }
  int64_t chunks() const { return B * ((L + 63) / 64); }
};

cuda::KdaChunkedVariant variant(int intra, int seq, unsigned launches = 7, bool f16 = false) {
  cuda::KdaChunkedVariant v;
  v.intra = intra;
  v.seq = seq;
  v.launches = launches;
  v.f16_recurrence = f16;
  return v;
}

void prefill(bool quick, int sms) {
  fmt::print("\n== KDA prefill: kda_chunked (chunk 64; TF32 recurrence, BF16 output products), FP32 state ==\n");
  const cuda::KdaChunkedVariant eng = cuda::kda_chunked_default_variant();
  fmt::print("engine's variant: intra {} seq {}{}\n", eng.intra, eng.seq, eng.f16_recurrence ? " FP16 recurrence" : "");
  fmt::print("{:<16} {:>10} {:>9} {:>14} {:>14} {:>18} {:>9}   {}\n", "shape", "engine ms", "Mtok/s",
             "i2+seq2 ms", "i2+seq4 ms", "i2+seq4 f16 ms", "ws GB", "FLA chunk_kda (ANCHORS)");
  struct Case {
    int64_t H, L, B;
    const char* fla;
  };
  std::vector<Case> cases = {{12, 8192, 1, "0.54 ms"},     {12, 32768, 1, "1.94 ms"}, {12, 131072, 1, "7.57 ms"},
                             {12, 8192, 8, "2.90 ms"},      {96, 32768, 1, "10.9 ms"}};
  if (quick) cases.resize(2);
  // Per (chunk, head) at Dk 128: intra reads q, k, g, v and writes the image; useful TF32 FLOPs of A, QK (lower
  // triangles) and W, U0 (T lower triangular). seq reads the image once from HBM per head (the value blocks
  // share it through L2) and writes o; FLOPs of Sᵀ·Wᵀ, the state update, Sᵀ·Q̃ᵀ and QK·v_new.
  const double img = double(cuda::kda_chunked_workspace_bytes(128, 1, 1, kDk) -
                            cuda::kda_chunked_workspace_bytes(64, 1, 1, kDk));  // one (chunk, head) image
  // The FP16-recurrence image: W, K̂ᵀ, U0ᵀ (64·136 + 2·128·72 elements) in 2 bytes instead of 4.
  const double img16 = img - 2.0 * (64.0 * (kDk + 8) + 2.0 * kDk * 72.0);
  const double intra_flop = 4.0 * (64.0 * 65.0 / 2.0) * kDk * 2.0;
  const double seq_flop = 3.0 * 64.0 * kDk * kDk * 2.0 + (64.0 * 65.0 / 2.0) * kDk * 2.0;
  for (const Case& c : cases) {
    PrefillCase pc(c.H, c.L, c.B);
    const int reps = quick ? 5 : (pc.T * c.H > 12 * 65536 ? 7 : 15);
    const double us_def = pc.us(eng, reps);
    const double us_22 = pc.us(variant(2, 2), reps);
    const double us_mc = pc.us(variant(2, 4), reps);
    const double us_f16 = pc.us(variant(2, 4, 7, true), reps);
    const std::string shape = fmt::format("H={} {}×{}", c.H, c.B, c.L);
    fmt::print("{:<16} {:>10.3f} {:>9.1f} {:>14.3f} {:>14.3f} {:>18.3f} {:>9.2f}   {}\n", shape, us_def / 1e3,
               double(pc.T) / us_def, us_22 / 1e3, us_mc / 1e3, us_f16 / 1e3, double(pc.ws_bytes) / 1e9, c.fla);
    const double n = double(pc.chunks() * c.H);
    const double in_bytes = 4.0 * double(pc.T) * double(pc.HD) * 4.0, o_bytes = double(pc.T) * double(pc.HD) * 4.0;
    // Launch by launch; "f16": the FP16 recurrence (images of img16 bytes). Each seq row runs on the images
    // the intra row above it left (same format).
    for (const bool f16 : {false, true}) {
      const double im = f16 ? img16 : img;
      for (int intra : {1, 2}) {
        if (f16 && intra == 1) continue;
        const double us = pc.us(variant(intra, 0, 3, f16), reps);
        fmt::print("  intra{}{} (+table) {:>8.3f} ms   HBM {:.2f} GB → {:.2f} TB/s   {:.1f} GFLOP TF32 → {:.0f} TFLOP/s\n",
                   intra, f16 ? " f16" : "    ", us / 1e3, (in_bytes + n * im) / 1e9,
                   (in_bytes + n * im) / (us * 1e-6) / 1e12, n * intra_flop / 1e9, n * intra_flop / (us * 1e-6) / 1e12);
      }
      for (int seq : {1, 2, 3, 4}) {
        if (f16 && seq == 1) continue;
        const double us = pc.us(variant(2, seq, 4, f16), reps);
        // One CTA per SM (the stages fill shared memory): chunk steps = chunks per sequence × waves.
        const double steps = double((c.L + 63) / 64) * std::ceil(double(c.B * c.H * (seq >= 3 ? 8 : 4)) / sms);
        fmt::print("  seq{}{}            {:>8.3f} ms   HBM {:.2f} GB → {:.2f} TB/s   {:.1f} GFLOP → {:.0f} TFLOP/s   "
                   "{:.2f} µs per chunk step ({:.0f} steps)\n",
                   seq, f16 ? " f16" : "    ", us / 1e3, (n * im + o_bytes) / 1e9,
                   (n * im + o_bytes) / (us * 1e-6) / 1e12, n * seq_flop / 1e9, n * seq_flop / (us * 1e-6) / 1e12,
                   us / steps, steps);
      }
    }
    if (c.H == 12 && c.L == 8192 && c.B == 1) {  // the token-by-token scan, for scale
      auto r = [&] {
        cuda::kda_recurrent(static_cast<float*>(pc.in.q.data()), static_cast<float*>(pc.in.k.data()),
                            static_cast<float*>(pc.in.v.data()), static_cast<float*>(pc.in.g.data()), pc.HD,
                            static_cast<float*>(pc.in.beta.data()), c.H, static_cast<int32_t*>(pc.cu.data()),
                            static_cast<int32_t*>(pc.slots.data()), static_cast<float*>(pc.pool.data()),
                            static_cast<float*>(pc.o.data()), c.B, c.H, kDk, nullptr);
      };
      fmt::print("  kda_recurrent   {:>8.3f} ms   (token by token, same shape)\n", median_us(r, 1, 3) / 1e3);
    }
  }
}

// Decode of B requests, one token each, rotating over disjoint slot sets of a pool of ≥ 2 GB (FP32 bytes).
struct DecodeCase {
  int64_t B, H, n_sets;
  Inputs in;
  cuda::DeviceBuffer cu, slots, o;
  DecodeCase(int64_t B_, int64_t H_)
      : B(B_), H(H_), n_sets(std::max<int64_t>(2, int64_t(std::ceil(2.0e9 / (double(B_) * H_ * kDk * kDk * 4))))),
        in(make_inputs(B_, H_, 11 + uint64_t(B_))), cu(size_t(B_ + 1) * 4), slots(size_t(n_sets * B_) * 4),
        o(size_t(B_ * H_ * kDk) * 4) {
    std::vector<int32_t> c(static_cast<size_t>(B + 1)), sl(static_cast<size_t>(n_sets * B));
    for (int64_t b = 0; b <= B; ++b) c[size_t(b)] = int32_t(b);
    for (size_t i = 0; i < sl.size(); ++i) sl[i] = int32_t(i);  // set s = slots [s·B, (s+1)·B)
    cu.copy_from_host(c.data(), c.size() * 4);
    slots.copy_from_host(sl.data(), sl.size() * 4);
  }
  // kernel: 0..2 = kda_decode with that KdaDecodeVariant, 3 = kda_recurrent, 4 = kda_decode without a variant
  // (the engine's call), 5 = kda_decode kKdaDecodeRegs, 6 = kda_decode kKdaDecodePrefetch.
  double us(void* pool, bool f16, int kernel, int reps) {
    int64_t set = 0;
    const int64_t HD = H * kDk;
    auto f = [&] {
      const int32_t* sl = static_cast<int32_t*>(slots.data()) + (set++ % n_sets) * B;
      const float *q = static_cast<float*>(in.q.data()), *k = static_cast<float*>(in.k.data()),
                  *v = static_cast<float*>(in.v.data()), *g = static_cast<float*>(in.g.data()),
                  *beta = static_cast<float*>(in.beta.data());
      const int32_t* cuu = static_cast<int32_t*>(cu.data());
      float* out = static_cast<float*>(o.data());
      const auto var = kernel == 4   ? cuda::kda_decode_default_variant()
                       : kernel == 5 ? cuda::kKdaDecodeRegs
                       : kernel == 6 ? cuda::kKdaDecodePrefetch
                                     : cuda::KdaDecodeVariant(kernel);
      if (f16) {
        auto* p = static_cast<uint16_t*>(pool);
        kernel != 3 ? cuda::kda_decode(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr, var)
                    : cuda::kda_recurrent(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr);
      } else {
        auto* p = static_cast<float*>(pool);
        kernel != 3 ? cuda::kda_decode(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr, var)
                    : cuda::kda_recurrent(q, k, v, g, HD, beta, H, cuu, sl, p, out, B, H, kDk, nullptr);
      }
    };
    return median_us(f, 10, reps, /*hold=*/true);
  }
  double tbps(double us, bool f16) const {
    return 2.0 * double(B * H * kDk * kDk) * (f16 ? 2 : 4) / (us * 1e-6) / 1e12;
  }
};

void decode(bool quick) {
  const int64_t H = 12;
  fmt::print("\n== KDA decode: one token per request, H={}, Dk={} (state traffic = 2 × B·H·Dk²·bytes) ==\n", H, kDk);
  fmt::print("{:<30} {:>6} {:>10} {:>10}   {}\n", "kernel", "B", "µs", "TB/s",
             "anchor (FLA fused_recurrent on our H200)");
  const std::vector<int64_t> batches = quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 8, 64, 256, 1024};
  auto fla = [](int64_t B) {
    return B == 1 ? "6.1 µs" : B == 8 ? "9.2 µs" : B == 64 ? "31.7 µs" : B == 256 ? "106.9 µs (3.8 TB/s)" : "—";
  };
  const char* names[] = {"kda_decode auto", "kda_decode blocks", "kda_decode stream", "kda_recurrent",
                         "kda_decode (engine)", "kda_decode regs", "kda_decode prefetch"};
  for (const int64_t B : batches) {
    DecodeCase dc(B, H);
    for (const bool f16 : {false, true}) {
      const size_t bytes = size_t(dc.n_sets * B * H * kDk * kDk) * (f16 ? 2 : 4);
      cuda::DeviceBuffer pool(bytes);
      KCUDA_CHECK(cudaMemset(pool.data(), 0, bytes));
      for (int kernel : {4, 0, 1, 2, 5, 6, 3}) {
        const double us = dc.us(pool.data(), f16, kernel, quick ? 50 : 200);
        fmt::print("{:<30} {:>6} {:>10.2f} {:>10.2f}   {}\n",
                   fmt::format("{} {}", names[kernel], f16 ? "f16" : "f32"), B, us, dc.tbps(us, f16),
                   !f16 && kernel == 4 ? fla(B) : "");
      }
    }
  }
}

// PERF lines only (FP32 state): the scoreboard's for kda_chunked variant `var` and the engine's decode kernel,
// then every variant under its own key.
void perf(const cuda::KdaChunkedVariant& var) {
  struct V {
    int intra, seq;
    bool f16;
  };
  const V all[] = {{1, 1, false}, {2, 1, false}, {2, 2, false}, {2, 3, false},
                   {2, 4, false}, {2, 2, true},  {2, 3, true},  {2, 4, true}};
  for (const int64_t L : {int64_t(32768), int64_t(8192)}) {
    PrefillCase pc(12, L, 1);
    fmt::print("PERF kda_prefill_us_h12_{}k {:.1f}\n", L / 1024, pc.us(var, 15));
    for (const V& v : all)
      fmt::print("PERF kda_prefill_us_h12_{}k_i{}s{}{} {:.1f}\n", L / 1024, v.intra, v.seq, v.f16 ? "h" : "",
                 pc.us(variant(v.intra, v.seq, 7, v.f16), 15));
    std::fflush(stdout);
  }
  for (const int64_t B : {int64_t(1), int64_t(1024)}) {
    DecodeCase dc(B, 12);
    const size_t bytes = size_t(dc.n_sets * B * 12 * kDk * kDk) * 4;
    cuda::DeviceBuffer pool(bytes);
    KCUDA_CHECK(cudaMemset(pool.data(), 0, bytes));
    for (const int kernel : {4, 1, 2, 5, 6}) {
      const double us = dc.us(pool.data(), false, kernel, 200);
      const char* suffix = kernel == 4   ? ""
                           : kernel == 1 ? "_blocks"
                           : kernel == 2 ? "_stream"
                           : kernel == 5 ? "_regs"
                                         : "_pf";
      if (B == 1) {
        fmt::print("PERF kda_decode_us_b1{} {:.2f}\n", suffix, us);
      } else {
        fmt::print("PERF kda_decode_tbps_b1024{} {:.3f}\n", suffix, dc.tbps(us, false));
      }
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, perf_only = false;
  std::string only;
  cuda::KdaChunkedVariant var;
  try {
    var = cuda::kda_chunked_default_variant();  // KESTREL_KDA_CHUNKED, as the engine reads it
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    int f16 = 0;
    if (a == "--quick") {
      quick = true;
    } else if (a == "--perf") {
      perf_only = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (a == "--variant" && i + 1 < argc &&
               std::sscanf(argv[i + 1], "%d,%d,%d", &var.intra, &var.seq, &f16) == 3) {
      var.f16_recurrence = f16 != 0;
      ++i;
    } else {
      fmt::print(stderr, "usage: bench_kda [--quick] [--only prefill|decode] [--perf [--variant INTRA,SEQ,F16]]\n");
      return 2;
    }
  }
  try {
    cudaDeviceProp p{};
    KCUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    fmt::print("device: {} ({} SMs, L2 {} MB)\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
    if (perf_only) {
      perf(var);
      return 0;
    }
    if (only.empty() || only == "decode") decode(quick);
    if (only.empty() || only == "prefill") prefill(quick, p.multiProcessorCount);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
