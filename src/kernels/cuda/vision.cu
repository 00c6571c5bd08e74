// MoonViT-V2 kernels (see vision.h): varlen non-causal attention on tensor cores, 2-D RoPE, GELUs.
//
// Attention layout: one CTA = 4 warps = 64 query rows of one (image, head); each warp owns 16 rows. The
// keys of the image stream through shared memory in tiles of 64, K and V both row-major [64 keys][dv + 8],
// stored with 16-byte stores (the +8 padding puts the 8 rows of an 8×8 ldmatrix read on 32 distinct banks
// for dv = 16, 32 and 128). Per tile a warp computes S = Q Kᵀ (16 × 64, m16n8k16 MMAs with the Q fragments
// held in registers for the whole kernel; K's B fragments by ldmatrix), scales it into the log2 domain, masks
// keys past the image's end, updates the running row max m and sum l (online softmax), rescales its O
// accumulators and adds P V, where P's fragments are the S accumulators of two adjacent 8-key groups
// re-packed to BF16 (the C layout of m16n8k8 pairs is the A layout of m16n8k16) and V's B fragments come
// from ldmatrix.trans of the row-major tile (which transposes each 8×8 block on the way to the registers).
// Fragment maps (PTX ISA, mma.m16n8k16 .bf16): lane = 4g + t;
//   A (16×16, row-major) regs: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}
//   B (16×8, "col" = n-major) regs: {(k 2t..2t+1, n g), (k 2t+8.., n g)}
//   C (16×8 f32): (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
//   ldmatrix .x4: lane l addresses row l % 8 of 8×8 matrix l / 8; register i receives matrix i, lane 4g + t
//   holding (row g, cols 2t, 2t+1) — with .trans (rows 2t, 2t+1, col g) — the lower half the first.
// So for S, K rows (keys) × 8 dims give (k = dim 2t.., n = key g) = B directly; for P V, V rows (keys) ×
// 8 dims through .trans give (k = key 2t.., n = dim g) = B. (Until 2026-12 V was transposed into shared
// memory with 2-byte stores, 16-way bank conflicts each: 2.36 ms per real-dims block on the H200, ~10 %
// of the BF16 rate.) Two stages: the next key tile is copied by cp.async (16 bytes a copy, zero-filled past
// the image's end, so masked keys meet finite V rows) while the warps work on the current one; dynamic
// shared memory, 2 × 2 × 64 × (dv + 8) × 2 bytes (68 KiB at dv = 128). __launch_bounds__(128, 3) keeps
// three CTAs per SM: ptxas then fits dv = 128 in 168 registers without spilling (177 unbounded, which
// would allow only two).
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/vision.h"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;
using dev::f32_to_bf16;

constexpr int kBQ = 64;  // query rows per CTA (4 warps × 16)
constexpr int kBK = 64;  // keys per shared-memory tile

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(f32_to_bf16(lo)) | (uint32_t(f32_to_bf16(hi)) << 16);
}
__device__ __forceinline__ uint32_t ld32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
// Four 8×8 bf16 matrices from shared memory (see the header): p = this lane's row (16-byte aligned).
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const uint16_t* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const uint16_t* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

using dev::cp_async16;  // 16-byte copies global → shared (device_util.cuh), zero-filled where !in
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::smem_addr;

template <int D>
constexpr int attn_smem_bytes() {
  return 2 * 2 * kBK * (D + 8) * 2;  // stages × (K, V) × keys × padded row × bf16
}

template <int D>
__global__ void __launch_bounds__(128, 3) attn_kernel(const uint16_t* __restrict__ qkv, int64_t ld, int64_t Wq,
                                                   const int32_t* __restrict__ row0, float scale_log2,
                                                   uint16_t* __restrict__ o, int64_t ldo) {
  static_assert(D % 16 == 0 && kBK % 16 == 0, "ldmatrix .x4 reads two 8-wide groups at a time");
  constexpr int KP = D + 8;
  // Stage st: K at smem + st·2·kBK·KP, V right after it; each bf16 [64 keys][D (+8)].
  extern __shared__ __align__(16) uint16_t smem[];
  const int img = blockIdx.z, h = blockIdx.y;
  const int64_t r0 = row0[img], N = int64_t(row0[img + 1]) - r0;
  const int64_t q0 = int64_t(blockIdx.x) * kBQ;
  if (q0 >= N) return;  // the whole CTA: no barrier is skipped by part of it
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint16_t* Qb = qkv + r0 * ld + int64_t(h) * D;  // bf16 q of row r0, head h
  const uint16_t* Kb = Qb + Wq;
  const uint16_t* Vb = Qb + 2 * Wq;
  const int64_t qa = q0 + warp * 16 + g, qb = qa + 8;  // this thread's two query rows (image-local)
  const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: this lane addresses row lr of matrix lm

  uint32_t qf[D / 16][4];  // A fragments of Q, 16 rows × D
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * t;
    qf[kk][0] = qa < N ? ld32(Qb + qa * ld + c) : 0u;
    qf[kk][1] = qb < N ? ld32(Qb + qb * ld + c) : 0u;
    qf[kk][2] = qa < N ? ld32(Qb + qa * ld + c + 8) : 0u;
    qf[kk][3] = qb < N ? ld32(Qb + qb * ld + c + 8) : 0u;
  }
  float acc[D / 8][4];  // O accumulators: 8-column group j = dims 8j..8j+7
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;  // rows qa, qb (log2 domain)

  // Issues the copies of the key tile at k0 into stage st (one commit group per tile).
  auto load_tile = [&](int64_t k0, int st) {
    uint16_t* Kd = smem + st * 2 * kBK * KP;
    uint16_t* Vd = Kd + kBK * KP;
    constexpr int kChunks = kBK * D / 8;  // 16-byte chunks of a tile
    for (int i = threadIdx.x; i < kChunks; i += 128) {
      const int key = i / (D / 8), c8 = (i % (D / 8)) * 8;
      const bool in = k0 + key < N;
      const int64_t off = in ? (k0 + key) * ld + c8 : 0;  // past the end: a valid address, 0 bytes read
      cp_async16(smem_addr(Kd + key * KP + c8), Kb + off, in);  // zeros past the image's end: finite V rows
      cp_async16(smem_addr(Vd + key * KP + c8), Vb + off, in);
    }
    cp_async_commit();
  };
  load_tile(0, 0);
  int st = 0;  // the stage holding the tile at k0
  for (int64_t k0 = 0; k0 < N; k0 += kBK, st ^= 1) {
    // The next tile goes to the other stage, whose last readers finished before the previous iteration's
    // closing barrier; then wait for this tile's own group (the newer one may stay in flight).
    if (k0 + kBK < N) {
      load_tile(k0 + kBK, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of this tile are visible
    const uint16_t* Ks = smem + st * 2 * kBK * KP;
    const uint16_t* Vs = Ks + kBK * KP;

    float s[kBK / 8][4];  // S = Q Kᵀ: 8-key group j = keys k0 + 8j .. +7
#pragma unroll
    for (int j = 0; j < kBK / 8; j += 2) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      s[j + 1][0] = s[j + 1][1] = s[j + 1][2] = s[j + 1][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        // matrices: (keys of group j, dims kk·16 + 0..7), (group j, + 8..15), (group j + 1, 0..7), (j + 1, 8..15)
        uint32_t b[4];
        ldsm_x4(b, Ks + ((j + (lm >> 1)) * 8 + lr) * KP + kk * 16 + (lm & 1) * 8);
        mma_bf16(s[j], qf[kk], b[0], b[1]);
        mma_bf16(s[j + 1], qf[kk], b[2], b[3]);
      }
    }
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = k0 + j * 8 + 2 * t + e < N;
        s[j][e] = valid ? s[j][e] * scale_log2 : -INFINITY;
        s[j][2 + e] = valid ? s[j][2 + e] * scale_log2 : -INFINITY;
        mx_a = fmaxf(mx_a, s[j][e]);
        mx_b = fmaxf(mx_b, s[j][2 + e]);
      }
    // the 4 lanes of a group share rows qa, qb
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    // every tile holds at least one valid key (k0 < N), so the new maxima are finite
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    const float al_a = exp2f(m_a - mn_a), al_b = exp2f(m_b - mn_b);  // 0 on the first tile (m = −inf)
    m_a = mn_a, m_b = mn_b;
    float rs_a = 0.0f, rs_b = 0.0f;
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[j][e] = exp2f(s[j][e] - m_a);  // masked keys: exp2(−inf) = 0
        s[j][2 + e] = exp2f(s[j][2 + e] - m_b);
        rs_a += s[j][e];
        rs_b += s[j][2 + e];
      }
    l_a = l_a * al_a + rs_a;  // per-lane partial sums, reduced over the group at the end
    l_b = l_b * al_b + rs_b;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] *= al_a, acc[j][1] *= al_a, acc[j][2] *= al_b, acc[j][3] *= al_b;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const uint32_t a[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                             pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        // .trans matrices: (keys kk·16 + 0..7, dims of group j), (keys + 8..15, group j), (0..7, j + 1),
        // (8..15, j + 1)
        uint32_t b[4];
        ldsm_x4_trans(b, Vs + (kk * 16 + (lm & 1) * 8 + lr) * KP + (j + (lm >> 1)) * 8);
        mma_bf16(acc[j], a, b[0], b[1]);
        mma_bf16(acc[j + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float ia = 1.0f / l_a, ib = 1.0f / l_b;
  uint16_t* Ob = o + r0 * ldo + int64_t(h) * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int c = j * 8 + 2 * t;
    if (qa < N) *reinterpret_cast<uint32_t*>(Ob + qa * ldo + c) = pack2(acc[j][0] * ia, acc[j][1] * ia);
    if (qb < N) *reinterpret_cast<uint32_t*>(Ob + qb * ldo + c) = pack2(acc[j][2] * ib, acc[j][3] * ib);
  }
}

__global__ void rope_kernel(uint16_t* qkv, int64_t ld, int64_t Wq, const int32_t* rc, int64_t T, int heads, int hd) {
  const int pairs = hd / 2;
  const int64_t n = T * 2 * heads * pairs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(i % pairs);
    int64_t r = i / pairs;
    const int hh = int(r % heads);
    r /= heads;
    const int which = int(r % 2);  // 0: q, 1: k
    const int64_t row = r / 2;
    const double pos = double(rc[2 * row + ((j % 2 == 0) ? 1 : 0)]);  // even pairs: column; odd: row
    const double f = exp(-4.0 * double(j / 2) / double(hd) * 9.210340371976184);  // 10000^(−4i/hd)
    float sn, cs;
    sincosf(float(pos * f), &sn, &cs);
    uint16_t* v = qkv + row * ld + which * Wq + int64_t(hh) * hd + 2 * j;
    const float a = bf16_to_f32(v[0]), b = bf16_to_f32(v[1]);
    v[0] = f32_to_bf16(a * cs - b * sn);
    v[1] = f32_to_bf16(a * sn + b * cs);
  }
}

__global__ void gelu_tanh_kernel(uint16_t* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = bf16_to_f32(x[i]);
    x[i] = f32_to_bf16(0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))));
  }
}
__global__ void gelu_erf_kernel(uint16_t* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = bf16_to_f32(x[i]);
    x[i] = f32_to_bf16(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));
  }
}

unsigned grid_for(int64_t n) { return unsigned(n < 1 ? 1 : (n + 255) / 256 < 132 * 16 ? (n + 255) / 256 : 132 * 16); }

}  // namespace

void vision_attention(const uint16_t* qkv, int64_t ld, int64_t Wq, const int32_t* row0, int n_images,
                      int64_t max_rows, int heads, int head_dim, uint16_t* o, int64_t ldo, cudaStream_t stream) {
  KCUDA_REQUIRE(n_images >= 0 && heads > 0 && max_rows >= 0, std::string("vision_attention: bad sizes"));
  KCUDA_REQUIRE(ld % 8 == 0 && Wq % 8 == 0 && Wq >= int64_t(heads) * head_dim && ld >= 3 * Wq && ldo % 2 == 0 &&
                    ldo >= int64_t(heads) * head_dim,
                std::string("vision_attention: ld, Wq must be multiples of 8 covering 3 × heads × head_dim"));
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(qkv) % 16 == 0 && reinterpret_cast<uintptr_t>(o) % 4 == 0,
                std::string("vision_attention: qkv must be 16-byte aligned, o 4-byte aligned"));
  if (n_images == 0 || max_rows == 0) return;
  const dim3 grid(unsigned((max_rows + kBQ - 1) / kBQ), unsigned(heads), unsigned(n_images));
  KCUDA_REQUIRE(grid.x <= 2147483647u && n_images <= 65535 && heads <= 65535,
                std::string("vision_attention: grid too large"));
  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(head_dim)));
  auto launch = [&](auto kernel, int smem) {
    KCUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, 128, smem, stream>>>(qkv, ld, Wq, row0, scale_log2, o, ldo);
  };
  switch (head_dim) {
    case 16: launch(attn_kernel<16>, attn_smem_bytes<16>()); break;
    case 32: launch(attn_kernel<32>, attn_smem_bytes<32>()); break;
    case 128: launch(attn_kernel<128>, attn_smem_bytes<128>()); break;
    default:
      KCUDA_REQUIRE(false, "vision_attention: head_dim " + std::to_string(head_dim) + " not in {16, 32, 128}");
  }
  KCUDA_CHECK_LAUNCH();
}

void vision_rope_qk(uint16_t* qkv, int64_t ld, int64_t Wq, const int32_t* rc, int64_t T, int heads, int head_dim,
                    cudaStream_t stream) {
  KCUDA_REQUIRE(head_dim % 4 == 0 && heads > 0 && T >= 0, std::string("vision_rope_qk: head_dim % 4, heads > 0"));
  if (T == 0) return;
  rope_kernel<<<grid_for(T * heads * head_dim), 256, 0, stream>>>(qkv, ld, Wq, rc, T, heads, head_dim);
  KCUDA_CHECK_LAUNCH();
}

void gelu_tanh_bf16(uint16_t* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  gelu_tanh_kernel<<<grid_for(n), 256, 0, stream>>>(x, n);
  KCUDA_CHECK_LAUNCH();
}
void gelu_erf_bf16(uint16_t* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  gelu_erf_kernel<<<grid_for(n), 256, 0, stream>>>(x, n);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
