// The tensor-core MLA attention kernel (src/kernels/cuda/mla_tc_body.h, the body mla_tc.cu runs on the GPU)
// executed on the CPU: every CUDA thread is a fiber, __syncthreads a barrier of the block, and the warp
// primitives are emulated from their PTX ISA definitions — mma.sync.m16n8k16 (bf16 or f16 fragments as
// the ISA lays them out over the lanes, f32 accumulation, subnormal operands kept), ldmatrix .x4 / .x4.trans
// (lane i of each group of 8 supplies a row address; thread t receives row t/4, elements 2(t%4), 2(t%4)+1,
// or the transpose), cp.async (an immediate copy, zero-filled past src_bytes), shuffles, the warp min/max,
// cvt e4m3x2 → f16x2 and the bf16x2 multiply. Shared memory starts as NaN bytes, so a read of anything the
// kernel did not write shows up.
//
// What this checks without a GPU: the kernel's index arithmetic (fragments, swizzle, page and selection
// lookups, the address pipeline, the FP8 path's permuted fragments, byte placement and per-group scales),
// masking, the online softmax and the split outputs, against the CPU twin
// cpu::mla_attn_absorbed over MlaCacheView::read_latent (the split merge and W_UV are applied here on the
// CPU). What it cannot check: timing, the asynchrony of cp.async, the real hardware's rounding inside the
// MMA (emulated with a double sum) and exp2f's last ulp. The GPU tests (tests/gpu/test_mla_tc_gpu.cpp)
// cover those. Shapes stay small (a few 64-key tiles): every warp collective is 32 fiber switches.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#include <ucontext.h>

#include "../test_rng.h"
#include "core/dtype.h"
#include "kernels/cpu/mla_ops.h"
#include "model/cache_view.h"

// ---- the emulated primitives (see mla_tc_body.h for the list) -------------------------------------------------
#define KTC_NS tc_emu
#define KTC_DEV inline
#define KTC_UNROLL

namespace kestrel::cuda::tc_emu {

struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __uint_as_float(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t __float_as_uint(float f) { return std::bit_cast<uint32_t>(f); }
using std::max;
using std::min;

// Cooperative threads: every CUDA thread of the CTA is a ucontext fiber on the calling OS thread; a fiber
// runs until it waits at a barrier and hands control back to the scheduler, which resumes the next one
// (round robin). Deterministic, and far cheaper than 256 OS threads.
struct Barrier {
  int n = 0, count = 0;
  uint64_t gen = 0;
};
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};
struct Copy {
  uint32_t dst;
  const void* src;
  int size, src_bytes;
};
struct Block {
  Barrier block_bar{256};
  std::vector<std::vector<std::vector<Copy>>> groups;  // deferred cp.async: per thread, per group
  Barrier warp_bar[8];
  uint32_t slot[8][2][32][8];  // per warp, double-buffered by barrier generation: lane → 8 words
  uint8_t* smem = nullptr;
  std::vector<Fiber> fibers;
  ucontext_t sched;
  std::function<void(int)> body;
};
Block* t_block = nullptr;  // the CTA being emulated
int t_tid = 0;             // the fiber running now
bool g_defer = false;      // cp.async lands at the last moment allowed (wait_group) instead of at once

inline void yield() { swapcontext(&t_block->fibers[size_t(t_tid)].ctx, &t_block->sched); }
inline void wait(Barrier& b) {
  const uint64_t g = b.gen;
  if (++b.count == b.n) {
    b.count = 0, ++b.gen;
    return;
  }
  while (b.gen == g) yield();
}
inline int lane_id() { return t_tid & 31; }
inline Barrier& wbar() { return t_block->warp_bar[t_tid >> 5]; }
// A warp collective: write this lane's words into the buffer of the current phase, wait for the warp, then
// read any lane's words of the same phase. Two phases alternate, so a fast lane that is already writing the
// next collective never overwrites words a slow lane still reads.
inline uint32_t* phase_buf() { return &t_block->slot[t_tid >> 5][wbar().gen & 1][0][0]; }
inline uint32_t* my_slot() { return phase_buf() + 8 * lane_id(); }
inline const uint32_t* lane_slot(const uint32_t* buf, int l) { return buf + 8 * (l & 31); }

inline void sync_block() { wait(t_block->block_bar); }
inline int shfl(int v, int src) {
  uint32_t* buf = phase_buf();
  my_slot()[0] = uint32_t(v);
  wait(wbar());
  return int(lane_slot(buf, src)[0]);
}
inline float shfl_xor(float v, int mask) {
  uint32_t* buf = phase_buf();
  my_slot()[0] = std::bit_cast<uint32_t>(v);
  wait(wbar());
  return std::bit_cast<float>(lane_slot(buf, lane_id() ^ mask)[0]);
}
inline int warp_min(int v) {
  uint32_t* buf = phase_buf();
  my_slot()[0] = uint32_t(v);
  wait(wbar());
  int m = INT_MAX;
  for (int l = 0; l < 32; ++l) m = std::min(m, int(lane_slot(buf, l)[0]));
  return m;
}
inline int warp_max(int v) {
  uint32_t* buf = phase_buf();
  my_slot()[0] = uint32_t(v);
  wait(wbar());
  int m = INT_MIN;
  for (int l = 0; l < 32; ++l) m = std::max(m, int(lane_slot(buf, l)[0]));
  return m;
}
inline bool warp_any(bool v) {
  uint32_t* buf = phase_buf();
  my_slot()[0] = v ? 1u : 0u;
  wait(wbar());
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || lane_slot(buf, l)[0] != 0;
  return any;
}
inline void smem_atomic_min(int* p, int v) { *p = std::min(*p, v); }  // fibers never interleave inside
inline void smem_atomic_max(int* p, int v) { *p = std::max(*p, v); }
template <typename T>
T ldg(const T* p) {
  return *p;
}
inline uint32_t smem_u32(const void* p) { return uint32_t(static_cast<const uint8_t*>(p) - t_block->smem); }
inline void do_copy(const Copy& c) {
  if (c.src_bytes) std::memcpy(t_block->smem + c.dst, c.src, size_t(c.src_bytes));
  std::memset(t_block->smem + c.dst + c.src_bytes, 0, size_t(c.size - c.src_bytes));
}
inline void cp_async_n(uint32_t dst, const void* src, int size, int src_bytes) {
  EXPECT_TRUE(src_bytes == 0 || src_bytes == size);
  const Copy c{dst, src, size, src_bytes};
  auto& g = t_block->groups[size_t(t_tid)];
  if (g_defer) {
    if (g.empty()) g.emplace_back();
    g.back().push_back(c);
  } else {
    do_copy(c);
  }
}
inline void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  EXPECT_EQ(dst % 16, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(src) % 16, 0u);
  cp_async_n(dst, src, 16, src_bytes);
}
inline void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  EXPECT_EQ(dst % 4, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(src) % 4, 0u);
  cp_async_n(dst, src, 4, src_bytes);
}
// Groups: the open one is the last; commit opens a new one; wait_group N completes all but the N newest
// committed groups (the open one, empty or not, is not committed).
inline void cp_commit() {
  if (g_defer) {
    auto& g = t_block->groups[size_t(t_tid)];
    if (g.empty()) g.emplace_back();
    g.emplace_back();
  }
}
template <int N>
void cp_wait() {
  if (!g_defer) return;
  auto& g = t_block->groups[size_t(t_tid)];  // g[0 .. size−2] committed, oldest first; g.back() open
  while (g.size() > size_t(N) + 1) {
    for (const Copy& c : g.front()) do_copy(c);
    g.erase(g.begin());
  }
}
inline uint32_t smem_word(uint32_t addr) {
  uint32_t v;
  std::memcpy(&v, t_block->smem + addr, 4);
  return v;
}
inline uint16_t smem_half(uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, t_block->smem + addr, 2);
  return v;
}
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of matrix i (8 × 8 b16, rows of 16 bytes).
inline void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  EXPECT_EQ(addr % 16, 0u);
  uint32_t* buf = phase_buf();
  my_slot()[0] = addr;
  wait(wbar());
  const int t = lane_id();
  uint32_t r[4];
  for (int i = 0; i < 4; ++i) r[i] = smem_word(lane_slot(buf, 8 * i + t / 4)[0] + 4 * (t % 4));
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  EXPECT_EQ(addr % 16, 0u);
  uint32_t* buf = phase_buf();
  my_slot()[0] = addr;
  wait(wbar());
  const int t = lane_id();
  uint32_t r[4];
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = smem_half(lane_slot(buf, 8 * i + 2 * (t % 4))[0] + 2 * (t / 4));
    const uint16_t hi = smem_half(lane_slot(buf, 8 * i + 2 * (t % 4) + 1)[0] + 2 * (t / 4));
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
// mma.m16n8k16.row.col bf16 (or f16) → f32: A[16×16] row-major fragments, B[16×8] column fragments (ISA
// layout). Operands decode exactly (subnormals included: the hardware keeps them).
template <bool F16>
inline void mma_any(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  uint32_t* buf = phase_buf();
  uint32_t* s = my_slot();
  for (int i = 0; i < 4; ++i) s[i] = a[i];
  s[4] = b0, s[5] = b1;
  wait(wbar());
  auto half = [](uint32_t v, int hi) {
    const uint16_t h = uint16_t(hi ? v >> 16 : v & 0xffffu);
    return F16 ? f16_to_f32(h) : bf16_to_f32(h);
  };
  // A[row][k]: lane (row % 8)·4 + (k % 8)/2, register (row ≥ 8) + 2·(k ≥ 8), half k % 2 (ISA Figure: mma
  // .m16n8k16 A fragment); B[k][n]: lane n·4 + (k % 8)/2, register b0/b1 by k ≥ 8, half k % 2.
  auto A = [&](int row, int k) {
    return half(lane_slot(buf, (row & 7) * 4 + (k & 7) / 2)[(row >> 3) + 2 * (k >> 3)], k & 1);
  };
  auto B = [&](int k, int n) { return half(lane_slot(buf, n * 4 + (k & 7) / 2)[4 + (k >> 3)], k & 1); };
  const int g = lane_id() >> 2, q = lane_id() & 3;
  float out[4];
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r >> 1), col = 2 * q + (r & 1);
    double acc = 0;
    for (int k = 0; k < 16; ++k) acc += double(A(row, k)) * double(B(k, col));
    out[r] = float(double(d[r]) + acc);
  }
  for (int r = 0; r < 4; ++r) d[r] = out[r];
}
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_any<false>(d, a, b0, b1); }
inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_any<true>(d, a, b0, b1); }
inline uint32_t pack_bf16(float lo, float hi) { return uint32_t(f32_to_bf16(lo)) | (uint32_t(f32_to_bf16(hi)) << 16); }
inline uint32_t pack_f16(float lo, float hi) { return uint32_t(f32_to_f16(lo)) | (uint32_t(f32_to_f16(hi)) << 16); }
// cvt.rn.f16x2.e4m3x2 of bytes 0, 1 (lo) or 2, 3 (hi): the lower byte → the low half; exact.
inline uint32_t e4m3x2_to_f16x2(uint32_t two) {
  return uint32_t(f32_to_f16(f8e4m3_to_f32(uint8_t(two & 0xffu)))) |
         (uint32_t(f32_to_f16(f8e4m3_to_f32(uint8_t((two >> 8) & 0xffu)))) << 16);
}
inline uint32_t e4m3x2_lo_to_f16x2(uint32_t v) { return e4m3x2_to_f16x2(v & 0xffffu); }
inline uint32_t e4m3x2_hi_to_f16x2(uint32_t v) { return e4m3x2_to_f16x2(v >> 16); }
// mul.rn.bf16x2: the f32 product of two bf16 values is exact (8 × 8 significant bits), then one RNE.
inline uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  auto one = [](uint32_t x, uint32_t y) { return uint32_t(f32_to_bf16(bf16_to_f32(uint16_t(x)) * bf16_to_f32(uint16_t(y)))); };
  return one(a & 0xffffu, b & 0xffffu) | (one(a >> 16, b >> 16) << 16);
}

}  // namespace kestrel::cuda::tc_emu

#include "kernels/cuda/mla_tc_body.h"

namespace kestrel::cuda::tc_emu {
namespace {

using kestrel::LatentFormat;

// Runs the grid (B × n_splits CTAs, one after the other), each CTA as 256 fibers.
void fiber_entry(unsigned lo, unsigned hi) {
  Block* blk = reinterpret_cast<Block*>((uintptr_t(hi) << 32) | uintptr_t(lo));
  blk->body(t_tid);
  blk->fibers[size_t(t_tid)].done = true;
  // Returning ends the fiber; uc_link brings control back to the scheduler.
}

template <int C, int R, bool FP8>
void run_grid(const Params& p) {
  using S = Shape<C, R, FP8>;
  auto blk = std::make_unique<Block>();
  for (auto& b : blk->warp_bar) b.n = 32;
  blk->fibers.resize(kThreads);
  for (auto& f : blk->fibers) f.stack.resize(size_t(256) << 10);
  std::vector<uint8_t> smem(size_t(S::SMEM));
  for (int by = 0; by < p.n_splits; ++by)
    for (int bx = 0; bx < p.B; ++bx) {
      std::fill(smem.begin(), smem.end(), uint8_t(0xFF));  // NaN in every float / bf16 view
      blk->smem = smem.data();
      blk->groups.assign(kThreads, {});
      blk->body = [&](int tid) { mla_tc_body<C, R, FP8>(p, smem.data(), tid, bx, by); };
      t_block = blk.get();
      const uintptr_t self = reinterpret_cast<uintptr_t>(blk.get());
      for (auto& f : blk->fibers) {
        f.done = false;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &blk->sched;
        makecontext(&f.ctx, reinterpret_cast<void (*)()>(fiber_entry), 2, unsigned(self & 0xffffffffu),
                    unsigned(self >> 32));
      }
      for (bool any = true; any;) {
        any = false;
        for (int t = 0; t < kThreads; ++t) {
          if (blk->fibers[size_t(t)].done) continue;
          any = true;
          t_tid = t;
          swapcontext(&blk->sched, &blk->fibers[size_t(t)].ctx);
        }
      }
      t_block = nullptr;
    }
}

using testutil::Rng;  // tests/test_rng.h

struct Case {
  cpu::MlaDims d;
  LatentFormat lf;
  int P;
  std::vector<int64_t> lens;                       // tokens per request
  std::vector<std::pair<int32_t, int32_t>> rows;   // (request, visible keys)
  int64_t Ksel = 0;                                // > 0: sparse, Ksel − (row % 3)·5 selected
  int chunk = 64;                                  // keys per split
  bool ohat = false;                               // normalised bf16 ô (needs a single split)
  bool ramp = false;                               // k_pe rising along the positions, q_pe > 0
  // lat_lo < lat_hi: each token's 128-column groups of ĉ get their own magnitude 2^U(lat_lo, lat_hi), values
  // m·u³ (u uniform in ±1: a few % of them e4m3 subnormals after the FP8 scale); q_nope times q_scale.
  float lat_lo = 0, lat_hi = 0, q_scale = 1;
};

void run_case(const Case& c, uint64_t seed, bool defer) {
  g_defer = defer;
  const auto& d = c.d;
  Rng rng(seed);
  const int64_t Hm = d.Hm, N = d.N, Dv = d.Dv, C = d.C, QK = d.qk(), W = d.cw();
  // Pool: pages shuffled over the requests, random bytes everywhere else.
  model::MlaCacheView shape;
  shape.latent_format = c.lf, shape.C = C, shape.R = d.R;
  const int64_t tb = shape.latent_token_bytes();
  int64_t pages = 2, max_blocks = 1;
  for (int64_t n : c.lens) pages += (n + c.P - 1) / c.P, max_blocks = std::max(max_blocks, (n + c.P - 1) / c.P);
  std::vector<int32_t> perm(static_cast<size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.next() % i]);
  std::vector<int32_t> tables(c.lens.size() * size_t(max_blocks), -1);
  size_t next = 0;
  for (size_t r = 0; r < c.lens.size(); ++r)
    for (int64_t j = 0; j < (c.lens[r] + c.P - 1) / c.P; ++j) tables[r * size_t(max_blocks) + size_t(j)] = perm[next++];
  std::vector<uint8_t> arena(size_t(pages * c.P * tb));
  for (auto& x : arena) x = uint8_t(rng.next());
  std::vector<std::vector<uint16_t>> lat(c.lens.size());
  for (size_t r = 0; r < c.lens.size(); ++r) {
    model::MlaCacheView v = shape;
    v.block_size = c.P, v.latent = arena.data();
    v.block_table = std::span<const int32_t>(tables.data() + r * size_t(max_blocks), size_t((c.lens[r] + c.P - 1) / c.P));
    std::vector<uint16_t> x(size_t(c.lens[r] * W));
    for (int64_t s = 0; s < c.lens[r]; ++s) {
      float mag = 1;
      for (int64_t i = 0; i < W; ++i) {
        if (i % 128 == 0 && c.lat_lo < c.lat_hi) mag = std::exp2(rng.uniform(c.lat_lo, c.lat_hi));
        float v = c.ramp && i >= C ? -2.0f + 4.0f * float(s) / float(c.lens[r]) + rng.uniform(-0.05f, 0.05f)
                                   : rng.uniform(-1.5f, 1.5f);
        if (c.lat_lo < c.lat_hi && i < C) {
          const float u = rng.uniform(-1.0f, 1.0f);
          v = mag * u * u * u;
        }
        x[size_t(s * W + i)] = f32_to_bf16(v);
      }
    }
    for (int64_t s = 0; s < c.lens[r]; ++s) v.write_latent(s, x.data() + s * W);
    lat[r].resize(x.size());
    v.read_latent(c.lens[r], lat[r].data());
  }
  // Rows, queries, weights, selections.
  const int64_t B = int64_t(c.rows.size());
  std::vector<int32_t> req, lens, sel;
  for (auto [r, n] : c.rows) req.push_back(r), lens.push_back(n);
  std::vector<uint16_t> q(size_t(B * Hm * QK)), kvb(size_t(Hm * (N + Dv) * C));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_bf16(rng.uniform(-1.0f, 1.0f) * (int64_t(i) % QK < N ? c.q_scale : 1.0f));
  if (c.ramp)
    for (int64_t i = 0; i < B * Hm; ++i)
      for (int64_t e = N; e < QK; ++e) q[size_t(i * QK + e)] = f32_to_bf16(rng.uniform(0.5f, 1.5f));
  for (auto& x : kvb) x = f32_to_bf16(rng.uniform(-0.08f, 0.08f));
  if (c.Ksel)
    for (int64_t i = 0; i < B; ++i) {
      const int64_t vis = lens[size_t(i)], cnt = std::min(vis, c.Ksel - (i % 3) * 5);
      std::vector<int32_t> all(static_cast<size_t>(vis));
      std::iota(all.begin(), all.end(), 0);
      for (int64_t k = 0; k < cnt; ++k) std::swap(all[size_t(k)], all[size_t(k + int64_t(rng.next() % uint64_t(vis - k)))]);
      std::sort(all.begin(), all.begin() + cnt);
      for (int64_t k = 0; k < c.Ksel; ++k) sel.push_back(k < cnt ? all[size_t(k)] : -1);
    }
  // The CPU twin.
  std::vector<uint16_t> ref(size_t(B * Hm * Dv));
  int64_t max_keys = 1;
  for (int64_t i = 0; i < B; ++i) {
    max_keys = std::max<int64_t>(max_keys, c.Ksel ? std::min<int64_t>(lens[size_t(i)], c.Ksel) : lens[size_t(i)]);
    cpu::mla_attn_absorbed(d, q.data() + i * Hm * QK, kvb.data(), lat[size_t(req[size_t(i)])].data(),
                           c.Ksel ? sel.data() + i * c.Ksel : nullptr, c.Ksel, 1, lens[size_t(i)] - 1,
                           ref.data() + i * Hm * Dv);
  }
  // q̃ = W_UKᵀ q_nope in FP32 (the GEMM of the launchers).
  std::vector<float> qt(size_t(B * Hm * C), 0.0f);
  for (int64_t i = 0; i < B * Hm; ++i) {
    const int64_t h = i % Hm;
    for (int64_t n = 0; n < N; ++n) {
      const float qn = bf16_to_f32(q[size_t(i * QK + n)]);
      for (int64_t cc = 0; cc < C; ++cc) qt[size_t(i * C + cc)] += qn * bf16_to_f32(kvb[size_t((h * (N + Dv) + n) * C + cc)]);
    }
  }
  const int n_splits = int((max_keys + c.chunk - 1) / c.chunk);
  ASSERT_TRUE(!c.ohat || n_splits == 1);
  std::vector<float> ml(size_t(B * n_splits * Hm * 2), std::nanf("")), acc(size_t(B * n_splits * Hm * C), std::nanf(""));
  std::vector<uint16_t> ohat(size_t(B * Hm * C), 0xFFFF);
  Params p{};
  p.arena = arena.data(), p.bt = tables.data(), p.bt_stride = max_blocks, p.req = req.data(), p.lens = lens.data();
  p.sel = c.Ksel ? sel.data() : nullptr, p.Ksel = c.Ksel, p.qt = qt.data(), p.q = q.data();
  p.part_ml = ml.data(), p.part_acc = acc.data(), p.ohat = c.ohat ? ohat.data() : nullptr;
  p.sl2 = 1.4426950408889634f / std::sqrt(float(QK));
  p.P = c.P, p.B = int(B), p.Hm = int(Hm), p.N = int(N), p.n_splits = n_splits, p.chunk = c.chunk;
  p.longest_first = c.ohat;
  const bool fp8 = c.lf == LatentFormat::fp8;
  if (C == 512)
    fp8 ? run_grid<512, 64, true>(p) : run_grid<512, 64, false>(p);
  else
    fp8 ? run_grid<64, 16, true>(p) : run_grid<64, 16, false>(p);
  // Merge the splits (log-sum-exp, as merge_uv_kernel) and apply W_UV.
  std::vector<float> got(ref.size());
  for (int64_t i = 0; i < B; ++i)
    for (int64_t h = 0; h < Hm; ++h) {
      std::vector<float> oh(static_cast<size_t>(C), 0.0f);
      if (c.ohat) {
        for (int64_t cc = 0; cc < C; ++cc) oh[size_t(cc)] = bf16_to_f32(ohat[size_t((i * Hm + h) * C + cc)]);
      } else {
        float M = -INFINITY, L = 0;
        for (int s = 0; s < n_splits; ++s) M = std::max(M, ml[size_t(((i * n_splits + s) * Hm + h) * 2)]);
        for (int s = 0; s < n_splits; ++s) {
          const float* m = &ml[size_t(((i * n_splits + s) * Hm + h) * 2)];
          if (m[0] == -INFINITY) continue;
          const float wv = std::exp2(m[0] - M);
          L += wv * m[1];
          for (int64_t cc = 0; cc < C; ++cc) oh[size_t(cc)] += wv * acc[size_t(((i * n_splits + s) * Hm + h) * C + cc)];
        }
        for (auto& v : oh) v /= L;
      }
      for (int64_t e = 0; e < Dv; ++e) {
        float s = 0;
        for (int64_t cc = 0; cc < C; ++cc) s += bf16_to_f32(kvb[size_t((h * (N + Dv) + N + e) * C + cc)]) * oh[size_t(cc)];
        got[size_t((i * Hm + h) * Dv + e)] = bf16_to_f32(f32_to_bf16(s));
      }
    }
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = bf16_to_f32(ref[i]);
    den += r * r;
  }
  const double rms = std::sqrt(den / double(ref.size()));
  int64_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = bf16_to_f32(ref[i]), e = std::fabs(double(got[i]) - r);
    num += std::isfinite(e) ? e * e : 1e30;
    if (!(e <= 0.05 * rms + std::fabs(r) / 32)) ++bad;
  }
  const double rel = std::sqrt(num / den);
  EXPECT_EQ(bad, 0) << "elements beyond tolerance";
  EXPECT_LE(rel, 1e-2) << "relative L2 error";
  std::printf("  C=%lld Hm=%lld %s P=%d rows=%lld splits=%d%s%s%s: rel L2 %.2e\n", (long long)C, (long long)Hm,
              fp8 ? "fp8" : "bf16", c.P, (long long)B, n_splits, c.Ksel ? " sparse" : "", c.ohat ? " ohat" : "",
              defer ? " (cp.async deferred)" : "", rel);
}

const cpu::MlaDims kNano{4, 32, 16, 32, 64}, kMini{12, 128, 64, 128, 512}, kMini16{16, 128, 64, 128, 512};

// Nano cases run twice: cp.async landing at once, and as late as wait_group allows (a tile read before its
// wait, or a stage refilled while still read, then shows up as NaN or a wrong value).
TEST(MlaTcEmulated, NanoDenseSplits) {
  for (bool defer : {false, true})
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8})
      run_case({kNano, lf, 16, {1, 130, 64}, {{0, 1}, {1, 63}, {1, 64}, {1, 65}, {1, 130}, {2, 64}, {2, 2}}, 0, 64},
               11, defer);
}

TEST(MlaTcEmulated, NanoSparseAndRamp) {
  for (bool defer : {false, true})
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      run_case({kNano, lf, 128, {90, 200, 5}, {{0, 90}, {1, 200}, {2, 5}, {1, 150}}, 64, 128}, 12, defer);
      Case ramp{kNano, lf, 16, {300}, {{0, 300}, {0, 129}}, 0, 320};
      ramp.ramp = true;
      run_case(ramp, 13, defer);
    }
}

TEST(MlaTcEmulated, NanoPrefillOhat) {
  Case c{kNano, LatentFormat::fp8, 16, {70, 40}, {}, 0, 128};
  for (int t = 0; t < 70; t += 7) c.rows.push_back({0, t + 1});
  for (int t = 30; t < 40; ++t) c.rows.push_back({1, t + 1});
  c.ohat = true;
  for (bool defer : {false, true}) run_case(c, 14, defer);
}

TEST(MlaTcEmulated, MiniShapes) {
  for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
    run_case({kMini, lf, 128, {130, 1}, {{0, 130}, {1, 1}, {0, 65}}, 0, 64}, 21, false);
    run_case({kMini16, lf, 64, {200}, {{0, 200}, {0, 100}}, 80 /* sparse, fewer than visible */, 128}, 22, lf == LatentFormat::fp8);
  }
  for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
    Case c{kMini, lf, 128, {150}, {{0, 150}, {0, 64}}, 0, 192};
    c.ohat = true;
    run_case(c, 23, true);
  }
}

// Scales that differ per token and per 128-column group (the FP8 path folds them into per-group partial
// scores and into P), e4m3 subnormals, latents small enough for the scale's clamp (2^−22) and large enough
// for scales past 2^7 (2^14 here), and q̃ tiny or large (the FP8 path's power-of-two scale of q̃ in f16).
TEST(MlaTcEmulated, ScalesAndMagnitudes) {
  struct Mag {
    float lo, hi, q;
  };
  // q̃ up to ~2^16 (past f16's range unless scaled) and down to ~2^−21 (f16 subnormals unless scaled).
  for (const Mag m : {Mag{-8, 4, 1.0f / 16}, Mag{-22, -14, 131072.0f}, Mag{16, 22, 1.0f / 1048576}})
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      Case c{kMini, lf, 64, {300}, {{0, 300}, {0, 130}}, 0, 128};
      c.lat_lo = m.lo, c.lat_hi = m.hi, c.q_scale = m.q;
      run_case(c, 24, lf == LatentFormat::fp8);
      Case n{kNano, lf, 16, {200}, {{0, 200}, {0, 77}}, 0, 64};
      n.lat_lo = m.lo, n.lat_hi = m.hi, n.q_scale = m.q;
      run_case(n, 25, false);
    }
}

}  // namespace
}  // namespace kestrel::cuda::tc_emu
