// A CPU emulation of the CUDA thread hierarchy, so that kernel sources written for the GPU run unchanged
// (compiled by g++) in the ordinary test suite, where no GPU exists. It is a correctness tool for index,
// layout and barrier logic, not a timing model.
//
// Every CUDA thread of a block is a fiber (ucontext) with its own stack; the fibers of one block run
// cooperatively, one at a time, each until it waits: at __syncthreads / a named barrier, at a warp
// collective (shuffles, mma.sync), at an unfinished mbarrier phase. Blocks of a grid run one after another; the
// CTAs of a thread-block cluster run together, each with its own dynamic shared memory, which the others reach
// through mapa (map_rank). threadIdx / blockIdx are set before each fiber resumes.
//
// What it checks on the way: shared memory starts as NaN bytes (0xFF) at every block, so a read of
// anything not written shows up; cp.async copies land only when the issuing thread waits for their group,
// and their destinations read as NaN until then (a read before the wait, or by another thread before a
// barrier, shows up); a block in which no fiber can progress (a barrier some threads never reach, an
// mbarrier phase that never completes) throws simt::Deadlock; the schedule order (threads forward or in
// reverse) is selectable, so an unordered write/read pair between threads is caught in one of the two; a read of
// the shared memory of a cluster's CTA that has exited (no cluster barrier before its exit) throws.
// mma.sync: the m16n8k8 TF32, m16n8k16 BF16 / FP16 and m16n8k32 E4M3 fragment layouts of the PTX ISA, operands
// taken as the hardware takes them (TF32: the top 19 bits), products summed in f64 and rounded to f32 once.
// 32-bit shared addresses (ld.shared, cp.async in inline PTX) are offsets into the CTA's dynamic shared memory,
// bounds-checked.
// Bulk copies (TMA) land immediately at issue; fences are no-ops.
// The host side of the CUDA runtime the kernel files' launchers call (launches, device properties, copies):
// simt_runtime.h, which the cuda_runtime.h stand-in includes.
// Length (past ~600 lines): the fiber scheduler and every emulated instruction family the kernel files use, in one
// header that each emulated translation unit includes first.
#pragma once

#include <ucontext.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"

#define KESTREL_SIMT_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))  // GNU form: allowed after `static` (alignas is not)
#define __grid_constant__

// ---- vector types and built-in variables ---------------------------------------------------------------------
struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline void __stcs(T* p, T v) {
  *p = v;
}
template <typename T>
inline void __stwb(T* p, T v) {
  *p = v;
}
template <typename T>
inline void __stcg(T* p, T v) {
  *p = v;
}
// The _rn intrinsics are there so that nvcc does not contract them into an FMA; tests/emu is compiled with
// -ffp-contract=off, so g++ does not either.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __ffs(unsigned x) { return x ? std::countr_zero(x) + 1 : 0; }
// As CUDA defines it: byte n of the result is byte (s >> 4n) & 7 of the eight bytes y:x (x the low four).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = uint64_t(y) << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= unsigned(v >> (8 * ((s >> (4 * n)) & 7u)) & 0xFFu) << (8 * n);
  return r;
}

// FP16 / BF16 as bit patterns, converted with the repository's own RNE rules (core/dtype.h).
struct __half {
  uint16_t x;
};
inline float __half2float(__half h) { return kestrel::f16_to_f32(h.x); }
inline __half __float2half_rn(float f) { return {kestrel::f32_to_f16(f)}; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
struct __nv_bfloat16 {
  uint16_t x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;  // x at the lower address (the low 16 bits of the 32-bit word)
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {kestrel::f32_to_bf16(f)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
using std::isinf;  // CUDA's device isnan / isinf are global functions
using std::isnan;

namespace simt {

struct Deadlock : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Copy {  // a pending cp.async
  void* dst;
  const void* src;
  uint32_t bytes, src_bytes;
  int group;
};

struct Fiber {
  ucontext_t ctx;
  uint3 tid, bid;
  int cta = 0;    // index of its CTA in the running cluster (= its rank)
  int local = 0;  // linear thread index in its CTA
  bool done = false;
  std::vector<Copy> pending;
  int group = 0;  // groups committed so far
  bool cluster_arrived = false;  // between barrier.cluster.arrive and .wait (cluster_arrive / cluster_wait)
  uint64_t cluster_gen = 0;      // the cluster barrier's generation it arrived at
};

struct Mbar {
  int expected = 0, pending = 0;
  int64_t tx = 0;
  int phase = 0;  // parity of the phases completed
};

struct Bar {
  int arrived = 0;
  uint64_t gen = 0;
};

struct Cta {
  unsigned char* smem = nullptr;  // the launch's dynamic shared memory
  size_t smem_bytes = 0;
  Bar bars[16];
  struct Warp {
    int arrived = 0;
    uint64_t gen = 0;
    uint64_t slot[2][32][12];
  };
  std::vector<Warp> warps;
  int live = 0;
};

// The CTAs of one cluster (one CTA without clusters), scheduled together.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<Cta> ctas;
  Bar cluster_bar;
  ucontext_t sched;
  int cur = -1, live = 0;
  uint64_t progress = 0;
  std::function<void()> body;
  std::map<const void*, Mbar> mbars;
  std::exception_ptr error;  // thrown inside a fiber; rethrown by launch
};

inline Block* g_block = nullptr;
// Schedules. threads / threads_reverse: every live thread resumed once per sweep, first to last or last to
// first (warps then advance in near lockstep). warps / warps_reverse: each warp in turn runs as far as it can
// (until all its threads wait on something outside the warp) before the next warp starts — the greatest skew
// between warps, which exposes a missing barrier between one warp's writes and another's reads. ctas: each CTA
// of a cluster in turn runs as far as it can before the next one starts (a CTA running ahead of the others).
enum class Schedule { threads, threads_reverse, warps, warps_reverse, ctas };
inline Schedule g_schedule = Schedule::threads;
inline size_t g_stack_bytes = 64 * 1024;

inline Fiber& self() { return g_block->fibers[size_t(g_block->cur)]; }
inline Cta& my_cta() { return g_block->ctas[size_t(self().cta)]; }
inline void yield() {
  Fiber& f = self();
  swapcontext(&f.ctx, &g_block->sched);
}

// Barriers count live threads: a thread that exits may complete one for the others.
inline void release_if_complete(Bar& bar, int live) {
  if (bar.arrived > 0 && bar.arrived >= live) {
    bar.arrived = 0;
    ++bar.gen;
  }
}

inline void trampoline() {
  Block* b = g_block;
  try {
    b->body();
  } catch (...) {
    if (!b->error) b->error = std::current_exception();
  }
  Fiber& f = b->fibers[size_t(b->cur)];
  f.done = true;
  --b->live;
  Cta& c = b->ctas[size_t(f.cta)];
  --c.live;
  ++b->progress;
  release_if_complete(c.bars[0], c.live);
  release_if_complete(b->cluster_bar, b->live);
  swapcontext(&f.ctx, &b->sched);
}

// A fresh context that enters trampoline on `stack` (kept out of line: getcontext returns twice).
[[gnu::noinline]] inline void init_fiber(Fiber& f, char* stack) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = g_stack_bytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, trampoline, 0);
}

// Runs `body` (one kernel call per thread) over grid × block with `smem_bytes` of dynamic shared memory per
// CTA; `cluster` (dividing grid) groups CTAs that run together and can reach each other's shared memory.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body,
                   dim3 cluster = dim3(1, 1, 1)) {
  const int n = int(block.x * block.y * block.z);
  const int nc = int(cluster.x * cluster.y * cluster.z);
  if (grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z)
    throw std::runtime_error("simt: the cluster does not divide the grid");
  const size_t smem_alloc = (smem_bytes + 127) / 128 * 128 + 128;
  std::vector<std::unique_ptr<unsigned char, decltype(&std::free)>> smem;
  for (int c = 0; c < nc; ++c)
    smem.emplace_back(static_cast<unsigned char*>(std::aligned_alloc(128, smem_alloc)), &std::free);
  gridDim = grid;
  blockDim = block;
  for (unsigned cz = 0; cz < grid.z; cz += cluster.z)
    for (unsigned cy = 0; cy < grid.y; cy += cluster.y)
      for (unsigned cx = 0; cx < grid.x; cx += cluster.x) {
        Block b;
        b.body = body;
        b.ctas.resize(size_t(nc));
        b.fibers.resize(size_t(n * nc));
        b.live = n * nc;
        g_block = &b;
        for (int c = 0; c < nc; ++c) {
          Cta& cta = b.ctas[size_t(c)];
          cta.smem = smem[size_t(c)].get();
          cta.smem_bytes = smem_bytes;
          std::memset(cta.smem, 0xFF, smem_bytes);
          cta.warps.resize(size_t((n + 31) / 32));
          cta.live = n;
          // Rank = x-fastest position in the cluster.
          const uint3 bid = {cx + unsigned(c) % cluster.x, cy + (unsigned(c) / cluster.x) % cluster.y,
                             cz + unsigned(c) / (cluster.x * cluster.y)};
          for (int i = 0; i < n; ++i) {
            Fiber& f = b.fibers[size_t(c * n + i)];
            f.tid = {unsigned(i) % block.x, (unsigned(i) / block.x) % block.y, unsigned(i) / (block.x * block.y)};
            f.bid = bid;
            f.cta = c;
            f.local = i;
            b.stacks.emplace_back(new char[g_stack_bytes]);
            init_fiber(f, b.stacks.back().get());
          }
        }
        const int total = n * nc;
        int stalled = 0;
        while (b.live > 0) {
          const uint64_t before = b.progress;
          auto resume = [&](int i) {
            Fiber& f = b.fibers[size_t(i)];
            if (f.done) return;
            b.cur = i;
            threadIdx = f.tid;
            blockIdx = f.bid;
            swapcontext(&b.sched, &f.ctx);
            if (b.error) {
              g_block = nullptr;
              std::rethrow_exception(b.error);
            }
          };
          if (g_schedule == Schedule::threads || g_schedule == Schedule::threads_reverse) {
            for (int k = 0; k < total; ++k) resume(g_schedule == Schedule::threads ? k : total - 1 - k);
          } else if (g_schedule == Schedule::ctas) {
            for (int c = 0; c < nc; ++c) {
              for (uint64_t mark = ~uint64_t(0); mark != b.progress;) {  // until a pass over the CTA changes nothing
                mark = b.progress;
                for (int i = c * n; i < c * n + n; ++i) resume(i);
              }
            }
          } else {
            const int wpc = (n + 31) / 32, nw = wpc * nc;  // warps per CTA, in the cluster
            for (int kw = 0; kw < nw; ++kw) {
              const int w = g_schedule == Schedule::warps ? kw : nw - 1 - kw;
              const int c = w / wpc, lo = c * n + 32 * (w % wpc), hi = std::min(c * n + n, lo + 32);
              for (uint64_t mark = ~uint64_t(0); mark != b.progress;) {  // until a pass over the warp changes nothing
                mark = b.progress;
                for (int i = lo; i < hi; ++i) resume(i);
              }
            }
          }
          // Two sweeps in a row without a barrier released, a phase completed or a thread finished: stuck.
          stalled = b.live > 0 && b.progress == before ? stalled + 1 : 0;
          if (stalled == 2) {
            g_block = nullptr;
            throw Deadlock("simt: cluster at block (" + std::to_string(cx) + "," + std::to_string(cy) + "," +
                           std::to_string(cz) + ") cannot progress");
          }
        }
        g_block = nullptr;
      }
}

inline void wait_bar(Bar& bar, int need) {
  Block& b = *g_block;
  const uint64_t gen = bar.gen;
  if (++bar.arrived >= need) {
    bar.arrived = 0;
    ++bar.gen;
    ++b.progress;
    return;
  }
  while (bar.gen == gen) yield();
}
// Barrier `id` of the calling CTA over `count` threads (count < 0: every live thread of the CTA).
inline void barrier(int id, int count) {
  Cta& c = my_cta();
  wait_bar(c.bars[id], count < 0 ? c.live : count);
}
// barrier.cluster.arrive + wait: every live thread of the cluster.
inline void cluster_barrier() { wait_bar(g_block->cluster_bar, g_block->live); }
// The same apart (barrier.cluster.arrive, later barrier.cluster.wait): arrive counts the thread in the current phase
// and goes on; wait returns once that phase completed. A thread must alternate them, as the PTX ISA requires.
inline void cluster_arrive() {
  Block& b = *g_block;
  Fiber& f = self();
  if (f.cluster_arrived) throw std::runtime_error("simt: barrier.cluster.arrive twice without a wait");
  f.cluster_arrived = true;
  f.cluster_gen = b.cluster_bar.gen;
  if (++b.cluster_bar.arrived >= b.live) {
    b.cluster_bar.arrived = 0;
    ++b.cluster_bar.gen;
    ++b.progress;
  }
}
inline void cluster_wait() {
  Fiber& f = self();
  if (!f.cluster_arrived) throw std::runtime_error("simt: barrier.cluster.wait without an arrive");
  f.cluster_arrived = false;
  while (g_block->cluster_bar.gen == f.cluster_gen) yield();
}

// All 32 lanes of the calling warp deposit `nwords` 64-bit words; returns the deposits of this generation,
// slot[lane][word], valid until the warp's next collective but one.
inline const uint64_t (*warp_exchange(const uint64_t* in, int nwords))[12] {
  Block& b = *g_block;
  const int t = self().local;
  Cta::Warp& w = my_cta().warps[size_t(t / 32)];
  const uint64_t gen = w.gen;
  std::memcpy(w.slot[gen & 1][t % 32], in, size_t(nwords) * 8);
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.gen;
    ++b.progress;
  } else {
    while (w.gen == gen) yield();
  }
  return w.slot[gen & 1];
}

// The address `p` (in the calling CTA's shared memory) has in CTA `rank` of the cluster (mapa). The shared memory
// of a CTA whose threads have all exited is gone (a cluster barrier missing before the exit): that throws.
template <typename T>
inline T* map_rank(T* p, int rank) {
  Cta& me = my_cta();
  const ptrdiff_t off = reinterpret_cast<unsigned char*>(p) - me.smem;
  Cta& them = g_block->ctas.at(size_t(rank));
  if (them.live == 0) throw std::runtime_error("simt: shared memory of a CTA of the cluster that has exited");
  return reinterpret_cast<T*>(them.smem + off);
}

inline int lane_id() { return self().local % 32; }

// 32-bit shared addresses (cvta.to.shared; what ld.shared and cp.async take in the kernels' inline PTX): the
// byte offset into the calling CTA's dynamic shared memory, the only shared memory they address that way here.
// Both directions are bounds-checked, so an address off the end of the launch's allocation throws.
inline uint32_t smem_handle(const void* p) {
  Cta& c = my_cta();
  const auto* b = static_cast<const unsigned char*>(p);
  if (b < c.smem || b > c.smem + c.smem_bytes)
    throw std::runtime_error("simt: a shared address outside the CTA's dynamic shared memory");
  return uint32_t(b - c.smem);
}
inline unsigned char* smem_at(uint32_t a, size_t bytes) {
  Cta& c = my_cta();
  if (size_t(a) + bytes > c.smem_bytes) throw std::runtime_error("simt: a shared access past the dynamic shared memory");
  return c.smem + a;
}

template <typename T>
inline T shfl_from(T v, int src) {
  static_assert(sizeof(T) <= 8);
  uint64_t in = 0;
  std::memcpy(&in, &v, sizeof(T));
  const auto* s = warp_exchange(&in, 1);
  T r;
  std::memcpy(&r, &s[src][0], sizeof(T));
  return r;
}

inline float tf32_operand(uint32_t bits) { return std::bit_cast<float>(bits & 0xFFFFE000u); }
enum class MmaType { tf32, bf16, f16 };
inline float half_operand(uint32_t word, int hi, MmaType t) {
  const uint16_t h = uint16_t(hi ? word >> 16 : word & 0xFFFF);
  return t == MmaType::bf16 ? kestrel::bf16_to_f32(h) : kestrel::f16_to_f32(h);
}

// mma.sync m16n8k8 TF32 / m16n8k16 BF16 or FP16, f32 accumulators d (in/out), per the PTX ISA fragment layouts.
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], MmaType type) {
  uint64_t in[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const auto* s = warp_exchange(in, 6);
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
    double acc = d[r];
    if (type == MmaType::tf32) {
      for (int kk = 0; kk < 8; ++kk) {
        const float av = tf32_operand(uint32_t(s[4 * (row & 7) + (kk & 3)][(row >> 3) + 2 * (kk >> 2)]));
        const float bv = tf32_operand(uint32_t(s[4 * col + (kk & 3)][4 + (kk >> 2)]));
        acc += double(av) * double(bv);
      }
    } else {
      for (int kk = 0; kk < 16; ++kk) {
        const float av =
            half_operand(uint32_t(s[4 * (row & 7) + ((kk & 7) >> 1)][(row >> 3) + 2 * (kk >> 3)]), kk & 1, type);
        const float bv = half_operand(uint32_t(s[4 * col + ((kk & 7) >> 1)][4 + (kk >> 3)]), kk & 1, type);
        acc += double(av) * double(bv);
      }
    }
    d[r] = float(acc);
  }
}

// mma.sync m16n8k32 e4m3 × e4m3 + f32 (PTX ISA fragment layouts for 8-bit types): A registers 0 / 1 hold rows
// g / g+8 at k = 4t..4t+3 (byte i = k 4t+i), registers 2 / 3 the same rows at k = 16+4t..; B registers 0 / 1
// column g at k = 4t.. / 16+4t... FP8 values are exact in f64; products summed in f64, rounded to f32 once.
inline void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint64_t in[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const auto* s = warp_exchange(in, 6);
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  auto e4m3 = [](uint64_t word, int byte) { return double(kestrel::f8e4m3_to_f32(uint8_t(word >> (8 * byte)))); };
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
    double acc = d[r];
    for (int kk = 0; kk < 32; ++kk) {
      const double av = e4m3(s[4 * (row & 7) + ((kk & 15) >> 2)][(row >> 3) + 2 * (kk >> 4)], kk & 3);
      const double bv = e4m3(s[4 * col + ((kk & 15) >> 2)][4 + (kk >> 4)], kk & 3);
      acc += av * bv;
    }
    d[r] = float(acc);
  }
}

// ldmatrix .x{n}: lane l's address is row l % 8 of tile l / 8; lane l receives word l % 4 of row l / 4 of each tile.
template <int N>
inline void ldmatrix(uint32_t (&r)[N], const void* row) {
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) throw std::runtime_error("simt: ldmatrix row not 16-byte aligned");
  uint64_t in = uint64_t(reinterpret_cast<uintptr_t>(row));
  const auto* s = warp_exchange(&in, 1);
  const int lane = lane_id();
  for (int i = 0; i < N; ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(uintptr_t(s[8 * i + lane / 4][0]));
    std::memcpy(&r[i], p + 4 * (lane % 4), 4);
  }
}

// cp.async: poison the destination now, copy when the issuing thread waits for the group.
inline void cp_async(void* dst, const void* src, uint32_t bytes, uint32_t src_bytes) {
  Fiber& f = self();
  std::memset(dst, 0xFF, bytes);
  f.pending.push_back({dst, src, bytes, src_bytes, f.group});
}
inline void cp_commit() { ++self().group; }
inline void cp_wait(int n) {  // complete every group but the n most recent
  Fiber& f = self();
  std::vector<Copy> keep;
  for (const Copy& c : f.pending) {
    if (c.group < f.group - n) {
      std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
    } else {
      keep.push_back(c);
    }
  }
  f.pending.swap(keep);
}

inline void mbar_check(Mbar& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.pending = m.expected;
    ++g_block->progress;
  }
}

}  // namespace simt

inline void __syncthreads() { simt::barrier(0, -1); }
// Fibers run one at a time and CTAs one after another: every write is visible at once, atomics are plain.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = int(unsigned(old) + unsigned(v));  // wraps as the hardware's does
  return old;
}
// A thread that spins on a flag gives the others the turn: a flag never set shows up as simt::Deadlock (no thread
// progresses), not as a hang.
inline void __nanosleep(unsigned) { simt::yield(); }
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
inline void __syncwarp(unsigned = 0xffffffffu) {  // every lane of the warp (a collective with nothing to swap)
  const uint64_t none = 0;
  simt::warp_exchange(&none, 1);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
  const int lane = simt::lane_id();
  return simt::shfl_from(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = simt::lane_id(), base = lane & ~(width - 1);
  const int src = lane - int(delta) >= base ? lane - int(delta) : lane;
  return simt::shfl_from(v, src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const int lane = simt::lane_id(), base = lane & ~(width - 1);
  return simt::shfl_from(v, base + ((lane ^ mask) & (width - 1)));
}
// Bit l set if lane l is in `mask` and its predicate is true (every lane of the warp takes part here).
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t in = pred != 0;
  const auto* s = simt::warp_exchange(&in, 1);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= unsigned(s[l][0] != 0 && (mask >> l & 1u)) << l;
  return r;
}

// Bit l set if lane l is in `mask` and holds the caller's value (every lane of the warp takes part here).
inline unsigned __match_any_sync(unsigned mask, unsigned v) {
  const uint64_t in = v;
  const auto* s = simt::warp_exchange(&in, 1);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= unsigned((mask >> l & 1u) && s[l][0] == in) << l;
  return r;
}

// The inline-PTX wrappers of src/kernels/cuda/kda_internal.cuh.
namespace kestrel::cuda::kda_detail {
template <typename T>
inline T* dyn_smem() {
  return reinterpret_cast<T*>(simt::my_cta().smem);
}
inline uint32_t to_tf32(float x) {  // cvt.rna.tf32.f32: round to nearest, ties away from zero
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return u;
  return (u + 0x1000u) & 0xFFFFE000u;
}
inline float tf32f(float x) { return std::bit_cast<float>(to_tf32(x)); }
inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  std::memcpy(&r, &v, 4);
  return r;
}
inline uint32_t pack_f16(float lo, float hi) {
  return uint32_t(kestrel::f32_to_f16(lo)) | (uint32_t(kestrel::f32_to_f16(hi)) << 16);
}
inline float f16lo(uint32_t w) { return kestrel::f16_to_f32(uint16_t(w & 0xFFFFu)); }
inline float f16hi(uint32_t w) { return kestrel::f16_to_f32(uint16_t(w >> 16)); }
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  simt::mma(d, a, b, simt::MmaType::tf32);
}
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  simt::mma(d, a, b, simt::MmaType::bf16);
}
inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  simt::mma(d, a, b, simt::MmaType::f16);
}
inline void mbar_init(uint64_t* bar, uint32_t count) {
  simt::g_block->mbars[bar] = simt::Mbar{int(count), int(count), 0, 0};
}
inline void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  simt::Mbar& m = simt::g_block->mbars.at(bar);
  --m.pending;
  m.tx += bytes;
  simt::mbar_check(m);
}
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  if (simt::g_block->mbars.at(bar).phase != int(parity)) return true;
  simt::yield();
  return false;
}
inline void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: bulk copy not 16-byte aligned");
  std::memcpy(dst, src, bytes);
  simt::Mbar& m = simt::g_block->mbars.at(bar);
  m.tx -= bytes;
  simt::mbar_check(m);
}
inline void ldsm_x4(uint32_t (&r)[4], const void* row) { simt::ldmatrix<4>(r, row); }
inline void ldsm_x2(uint32_t (&r)[2], const void* row) { simt::ldmatrix<2>(r, row); }
inline uint32_t cluster_rank() { return uint32_t(simt::self().cta); }
inline void cluster_sync() { simt::cluster_barrier(); }
inline void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
  simt::Mbar& m = simt::g_block->mbars.at(simt::map_rank(bar, int(rank)));
  --m.pending;
  simt::mbar_check(m);
}
inline bool mbar_try_wait_cluster(uint64_t* bar, uint32_t parity) { return mbar_try_wait(bar, parity); }
inline void bulk_g2s_multicast(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint16_t mask) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: bulk copy not 16-byte aligned");
  for (int r = 0; r < 16; ++r) {
    if (!(mask >> r & 1)) continue;
    std::memcpy(simt::map_rank(dst, r), src, bytes);
    simt::Mbar& m = simt::g_block->mbars.at(simt::map_rank(bar, r));
    m.tx -= bytes;
    simt::mbar_check(m);
  }
}
inline void fence_mbarrier_init() {}
inline void fence_proxy_async() {}
template <int ID, int COUNT>
inline void named_barrier() {
  simt::barrier(ID, COUNT);
}
inline void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: cp.async of 16 bytes not 16-byte aligned");
  simt::cp_async(dst, src, 16, src_bytes);
}
inline void cp_async8(void* dst, const void* src) {
  if (reinterpret_cast<uintptr_t>(dst) % 8 != 0 || reinterpret_cast<uintptr_t>(src) % 8 != 0)
    throw std::runtime_error("simt: cp.async of 8 bytes not 8-byte aligned");
  simt::cp_async(dst, src, 8, 8);
}
inline void cp_async_commit() { simt::cp_commit(); }
template <int N>
inline void cp_async_wait() {
  simt::cp_wait(N);
}
}  // namespace kestrel::cuda::kda_detail

// The inline-PTX wrappers of src/kernels/cuda/moe_mma.cuh (and moe_t8p.cu's ld_act16x2), as the PTX ISA defines the
// instructions. Vector loads must be naturally aligned there (a misaligned one faults): so here.
namespace kestrel::cuda::moe_dev {
template <size_t A>
inline const void* aligned_global(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % A != 0) throw std::runtime_error(std::string("simt: misaligned ") + what);
  return p;
}
template <typename T>
inline T load_as(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
// ld.global.nc.L1::no_allocate.v4.u32 / .u32 (weights) and ld.global.v4.u32 (activations).
inline uint4 ld_stream16(const uint8_t* p) { return load_as<uint4>(aligned_global<16>(p, "ld.global.nc.v4.u32")); }
inline uint32_t ld_stream4(const uint8_t* p) { return load_as<uint32_t>(aligned_global<4>(p, "ld.global.nc.u32")); }
inline uint4 ld_act16(const uint16_t* p) { return load_as<uint4>(aligned_global<16>(p, "ld.global.v4.u32")); }
// ld.acquire.gpu: grids run one after another here, so whatever released the flag has finished: a plain load.
inline int ld_acquire_gpu(const int32_t* p) { return load_as<int>(aligned_global<4>(p, "ld.acquire.gpu.b32")); }
// ld.shared.v4.u32 / .u32 at a 32-bit shared address (simt::smem_handle's offsets, bounds-checked).
inline uint4 lds128(uint32_t addr) {
  if (addr % 16 != 0) throw std::runtime_error("simt: misaligned ld.shared.v4.u32");
  return load_as<uint4>(simt::smem_at(addr, 16));
}
inline uint32_t lds32(uint32_t addr) {
  if (addr % 4 != 0) throw std::runtime_error("simt: misaligned ld.shared.u32");
  return load_as<uint32_t>(simt::smem_at(addr, 4));
}
// cp.async.ca.shared.global, 4 bytes: lands at the wait for its group (simt::cp_async).
inline void cp_async4(uint32_t dst, const void* src) {
  if (dst % 4 != 0) throw std::runtime_error("simt: misaligned cp.async of 4 bytes");
  simt::cp_async(simt::smem_at(dst, 4), aligned_global<4>(src, "cp.async source"), 4, 4);
}
// griddepcontrol.wait / .launch_dependents: the grid before has finished when this one starts.
inline void griddep_wait() {}
inline void griddep_launch() {}
// barrier.cluster.arrive / .wait (the cluster's CTAs run together, simt::launch), and ld.shared::cluster through
// mapa: p must lie in the calling CTA's dynamic shared memory (the only shared memory that has a place in every CTA
// here: `__shared__` arrays are one static array for all CTAs), bounds-checked.
inline void cluster_arrive() { simt::cluster_arrive(); }
inline void cluster_wait() { simt::cluster_wait(); }
inline void cluster_sync() { simt::cluster_barrier(); }
inline float ld_shared_cluster(const float* p, uint32_t rank) {
  simt::smem_at(simt::smem_handle(p), sizeof(float));
  return load_as<float>(simt::map_rank(const_cast<float*>(p), int(rank)));
}
// mul.rn.bf16x2: each half the BF16 product rounded to nearest even, subnormals kept. The product of two BF16 values
// (8-bit significands) has at most 16 significant bits, so FP32 holds it exactly unless it lies below 2^-134, where
// both this and the direct rounding give 0 (below half the least BF16 subnormal, 2^-133): one rounding either way.
inline uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d = 0;
  for (int h = 0; h < 2; ++h) {
    const float p = kestrel::bf16_to_f32(uint16_t(a >> (16 * h))) * kestrel::bf16_to_f32(uint16_t(b >> (16 * h)));
    d |= uint32_t(kestrel::f32_to_bf16(p)) << (16 * h);
  }
  return d;
}
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, C = 0 (mma_first) or C = D (mma_acc).
inline void mma_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  simt::mma(d, a, b, simt::MmaType::bf16);
}
inline void mma_acc(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  simt::mma(d, a, b, simt::MmaType::bf16);
}
}  // namespace kestrel::cuda::moe_dev
namespace kestrel::cuda::moe_detail {
// moe_t8p.cu: two ld.global.v4.u32, at p and 64 bytes on.
inline void ld_act16x2(const uint16_t* p, uint4 (&b)[2]) {
  b[0] = moe_dev::ld_act16(p);
  b[1] = moe_dev::ld_act16(p + 32);
}
}  // namespace kestrel::cuda::moe_detail
