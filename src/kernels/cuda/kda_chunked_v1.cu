// First variants of the chunk-parallel KDA scan's intra and seq launches (kda_chunked.cu has the math, the
// image layout and the entry points; kda.h the contract): intra1 holds a whole (chunk, head) in one 512-thread
// CTA (190 KB of shared memory), seq1 gives each warp all Dk keys of 16 value columns. Kept next to the second
// variants (kda_chunked_intra2.cu, kda_chunked_seq2.cu) so that benchmarks can compare them on the same GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda::kda_detail {
namespace {

constexpr int kIntraThreads = 512;  // 16 warps
constexpr int kSeqWarps = 2;        // a variant-1 seq CTA owns 16·kSeqWarps value columns
constexpr int kBV = 16 * kSeqWarps;

// Variant-1 intra shared memory (floats): Ks, Qs, Gs, E1 [C][KP]; Ek, Eq [16][KP]; Am, Tm [C][LP]; Xs [3][16][16];
// bs [C]. KP ≡ LP ≡ 4 (mod 32): 4-byte fragment loads (row g, column t) hit 32 distinct banks.
template <int K>
struct IntraSmem {
  static constexpr int KP = K + 4, LP = kC + 4;
  static constexpr size_t floats = size_t(4 * kC * KP + 2 * 16 * KP + 2 * kC * LP + 3 * 256 + kC);
  static constexpr size_t bytes = floats * 4;
};

// ---- 2. intra-chunk products -----------------------------------------------------------------------------------
template <int K>
__global__ void __launch_bounds__(kIntraThreads, 1)
    intra_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                 const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ cseq,
                 int B, char* __restrict__ imgs, int H) {
  using I = Img<K>;
  constexpr int KP = IntraSmem<K>::KP, LP = IntraSmem<K>::LP, NT = kIntraThreads;
  float* sm = dyn_smem<float>();
  float* Ks = sm;              // [C][KP] k, later β·e^G ⊙ k (TF32)
  float* Qs = Ks + kC * KP;    // [C][KP] q
  float* Gs = Qs + kC * KP;    // [C][KP] cumulative log2-decay G·log2e (rows ≥ n repeat row n−1)
  float* E1 = Gs + kC * KP;    // [C][KP] k_s e^{r−G_s} for the current row block, later β·v (TF32)
  float* Ek = E1 + kC * KP;    // [16][KP] k_t e^{G_t−r}
  float* Eq = Ek + 16 * KP;    // [16][KP] q_t e^{G_t−r}
  float* Am = Eq + 16 * KP;    // [C][LP] A_ts, later L = β_t A_ts (s < t), zero elsewhere
  float* Tm = Am + kC * LP;    // [C][LP] QK_ts, later T
  float* Xs = Tm + kC * LP;    // [3][16][16] Σ_m L_im T_mj of one block row
  float* bs = Xs + 3 * 256;    // [C] β (0 for rows ≥ n)

  const int ch = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  if (ch >= cs[B]) return;
  const int b = cseq[ch];
  const int64_t t0 = int64_t(cu[b]) + int64_t(ch - cs[b]) * kC;
  const int n = int(min(int64_t(kC), int64_t(cu[b + 1]) - t0));
  char* img = imgs + (size_t(ch) * H + h) * I::bytes;

  // Phase 1: 16-byte loads, all issued before the first shared store; v stays in registers until phase 4.
  constexpr int K4 = K / 4, NL = kC * K4 / NT;
  static_assert(NL >= 1 && kC * K4 % NT == 0, "load mapping");
  float4 vr[NL];
  {
    float4 kr[NL], qr[NL], gr[NL];
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int idx = tid + l * NT, t = idx / K4, i = 4 * (idx % K4);
      const int64_t row = (t0 + t) * ld + int64_t(h) * K + i;
      const bool ok = t < n;
      kr[l] = ok ? __ldg(reinterpret_cast<const float4*>(k + row)) : z;
      qr[l] = ok ? __ldg(reinterpret_cast<const float4*>(q + row)) : z;
      gr[l] = ok ? __ldg(reinterpret_cast<const float4*>(g + row)) : z;
      vr[l] = ok ? __ldg(reinterpret_cast<const float4*>(v + row)) : z;
    }
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int idx = tid + l * NT, t = idx / K4, i = 4 * (idx % K4);
      *reinterpret_cast<float4*>(Ks + t * KP + i) = kr[l];
      *reinterpret_cast<float4*>(Qs + t * KP + i) = qr[l];
      *reinterpret_cast<float4*>(Gs + t * KP + i) = gr[l];
    }
  }
  if (tid < kC) bs[tid] = tid < n ? beta[(t0 + tid) * ld_beta + h] : 0.0f;
  __syncthreads();

  // Phase 2: G by channel, 4 lanes per channel (one 16-token segment each), running sums in f64.
  if (tid < 4 * K) {  // whole warps: 4K is a multiple of 32
    const int i = tid >> 2, p = tid & 3;
    double loc[16], acc = 0.0;
#pragma unroll
    for (int tt = 0; tt < 16; ++tt) {
      acc += double(Gs[(16 * p + tt) * KP + i]);
      loc[tt] = acc;
    }
    const int base = lane & ~3;
    const double s0 = __shfl_sync(0xffffffffu, acc, base), s1 = __shfl_sync(0xffffffffu, acc, base + 1),
                 s2 = __shfl_sync(0xffffffffu, acc, base + 2);
    double excl = 0.0;
    if (p > 0) excl = s0;
    if (p > 1) excl = excl + s1;
    if (p > 2) excl = excl + s2;
#pragma unroll
    for (int tt = 0; tt < 16; ++tt) Gs[(16 * p + tt) * KP + i] = float((excl + loc[tt]) * kLog2e);
  }
  __syncthreads();

  // Phase 3: A and QK by 16-row blocks j (reference r = G at row 16j − 1, or 0).
  const int nb = (n + 15) / 16;
  for (int j = 0; j < nb; ++j) {
    for (int idx = tid; idx < 16 * K; idx += NT) {
      const int tt = idx / K, i = idx % K, t = 16 * j + tt;
      const float r = j ? Gs[(16 * j - 1) * KP + i] : 0.0f;
      const float e = exp2f(Gs[t * KP + i] - r);  // ≤ 1
      Ek[tt * KP + i] = tf32f(Ks[t * KP + i] * e);
      Eq[tt * KP + i] = tf32f(Qs[t * KP + i] * e);
    }
    for (int idx = tid; idx < 16 * (j + 1) * K; idx += NT) {
      const int s = idx / K, i = idx % K;
      const float r = j ? Gs[(16 * j - 1) * KP + i] : 0.0f;
      E1[s * KP + i] = tf32f(Ks[s * KP + i] * exp2f(r - Gs[s * KP + i]));  // ≤ e^80
    }
    __syncthreads();
    // Jobs: (product, 8-column tile of s < 16(j+1)); entries above the diagonal are finite and unused.
    for (int job = warp; job < 4 * (j + 1); job += NT / 32) {
      const int prod = job & 1, nt = job >> 1;
      const float* Aop = prod ? Eq : Ek;
      const float* Bop = E1 + 8 * nt * KP;
      float c[2][4] = {};  // even / odd k-steps: two independent mma chains
#pragma unroll 4
      for (int kk = 0; kk < K / 8; ++kk) {
        const int col = 8 * kk + tq;
        const uint32_t a[4] = {__float_as_uint(Aop[gq * KP + col]), __float_as_uint(Aop[(gq + 8) * KP + col]),
                               __float_as_uint(Aop[gq * KP + col + 4]), __float_as_uint(Aop[(gq + 8) * KP + col + 4])};
        const uint32_t bb[2] = {__float_as_uint(Bop[gq * KP + col]), __float_as_uint(Bop[gq * KP + col + 4])};
        mma_tf32(c[kk & 1], a, bb);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) c[0][e] += c[1][e];
      float* out = (prod ? Tm : Am) + 16 * j * LP + 8 * nt + 2 * tq;
      out[gq * LP] = c[0][0];
      out[gq * LP + 1] = c[0][1];
      out[(gq + 8) * LP] = c[0][2];
      out[(gq + 8) * LP + 1] = c[0][3];
    }
    __syncthreads();
  }

  // Phase 4: L (in place), QK → image (bf16, masked), Q̃ → image (bf16), K̂ᵀ and eG → image (f32).
  // Rows t ≥ 16·nb were never computed: masked to zero here.
  {
    uint32_t* aimg = reinterpret_cast<uint32_t*>(img + I::a_off);
    for (int idx = tid; idx < kC * kC / 2; idx += NT) {
      const int t = idx >> 5, s = 2 * (idx & 31);
      const bool row_ok = t < 16 * nb;
      const float a0 = row_ok && s < t ? bs[t] * Am[t * LP + s] : 0.0f;
      const float a1 = row_ok && s + 1 < t ? bs[t] * Am[t * LP + s + 1] : 0.0f;
      const float q0 = row_ok && s <= t ? Tm[t * LP + s] : 0.0f;
      const float q1 = row_ok && s + 1 <= t ? Tm[t * LP + s + 1] : 0.0f;
      Am[t * LP + s] = a0;
      Am[t * LP + s + 1] = a1;
      aimg[(t * I::APQ + s) / 2] = pack_bf16(q0, q1);
    }
    uint32_t* qimg = reinterpret_cast<uint32_t*>(img + I::q_off);
    for (int idx = tid; idx < kC * K / 2; idx += NT) {
      const int t = idx / (K / 2), i = 2 * (idx % (K / 2));
      qimg[(t * I::KPQ + i) / 2] =
          pack_bf16(Qs[t * KP + i] * exp2f(Gs[t * KP + i]), Qs[t * KP + i + 1] * exp2f(Gs[t * KP + i + 1]));
    }
    float* khimg = reinterpret_cast<float*>(img + I::kh_off);
    for (int idx = tid; idx < K * (kC / 4); idx += NT) {
      const int i = idx % K, s = 4 * (idx / K);
      const float gc = Gs[(kC - 1) * KP + i];
      float4 r;
      r.x = tf32f(Ks[s * KP + i] * exp2f(gc - Gs[s * KP + i]));
      r.y = tf32f(Ks[(s + 1) * KP + i] * exp2f(gc - Gs[(s + 1) * KP + i]));
      r.z = tf32f(Ks[(s + 2) * KP + i] * exp2f(gc - Gs[(s + 2) * KP + i]));
      r.w = tf32f(Ks[(s + 3) * KP + i] * exp2f(gc - Gs[(s + 3) * KP + i]));
      *reinterpret_cast<float4*>(khimg + i * I::TP + s) = r;
    }
    if (tid < K) reinterpret_cast<float*>(img + I::e_off)[tid] = exp2f(Gs[(kC - 1) * KP + tid]);
  }
  __syncthreads();

  // β·e^G ⊙ k into Ks and β·v into E1 (the B operands of W and U0); T's 16×16 diagonal blocks.
  for (int idx = tid; idx < kC * K; idx += NT) {
    const int t = idx / K, i = idx % K;
    Ks[t * KP + i] = tf32f(bs[t] * Ks[t * KP + i] * exp2f(Gs[t * KP + i]));
  }
#pragma unroll
  for (int l = 0; l < NL; ++l) {
    const int idx = tid + l * NT, t = idx / K4, i = 4 * (idx % K4);
    const float bt = bs[t];
    *reinterpret_cast<float4*>(E1 + t * KP + i) =
        make_float4(tf32f(bt * vr[l].x), tf32f(bt * vr[l].y), tf32f(bt * vr[l].z), tf32f(bt * vr[l].w));
  }
  if (tid < kC) {  // column c of (I + L_dd)^−1, forward substitution in registers
    const int d = tid >> 4, c = tid & 15;
    const float* Ld = Am + 16 * d * LP + 16 * d;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float acc = 0.0f;
#pragma unroll
      for (int m = 0; m < r; ++m) acc = fmaf(Ld[r * LP + m], x[m], acc);
      x[r] = r < c ? 0.0f : (r == c ? 1.0f : -acc);
    }
    float* Td = Tm + 16 * d * LP + 16 * d + c;
#pragma unroll
    for (int r = 0; r < 16; ++r) Td[r * LP] = x[r];
  }
  __syncthreads();

  // Phase 5: block rows i = 1..3 of T: X_ij = Σ_{16j ≤ m < 16i} L[16i + r][m] T[m][16j + c], T_ij = −T_ii X_ij.
#pragma unroll 1
  for (int i = 1; i < 4; ++i) {
    for (int idx = tid; idx < 256 * i; idx += NT) {
      const int j = idx >> 8, r = (idx >> 4) & 15, c = idx & 15;
      const float* Lr = Am + (16 * i + r) * LP;
      float acc = 0.0f;
      for (int m = 16 * j; m < 16 * i; ++m) acc = fmaf(Lr[m], Tm[m * LP + 16 * j + c], acc);
      Xs[idx] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < 256 * i; idx += NT) {
      const int j = idx >> 8, r = (idx >> 4) & 15, c = idx & 15;
      const float* Tr = Tm + (16 * i + r) * LP + 16 * i;
      const float* X = Xs + 256 * j;
      float acc = 0.0f;
      for (int x = 0; x <= r; ++x) acc = fmaf(Tr[x], X[x * 16 + c], acc);
      Tm[(16 * i + r) * LP + 16 * j + c] = -acc;
    }
    __syncthreads();
  }

  // Phase 6: W = T·(β e^G ⊙ K) → image (TF32), U0 = T·(β V) → image transposed (f32). A job is (product,
  // 16-column pair of n-tiles, 16-row m-tile); the m-tile rotates with the warp so the triangular k-extent
  // (2(m+1) steps) is spread evenly.
  {
    constexpr int NP = K / 16, PN = 2 * NP, QW = PN / 4;
    static_assert(PN % 4 == 0, "job mapping");
    float* wimg = reinterpret_cast<float*>(img + I::w_off);
    float* uimg = reinterpret_cast<float*>(img + I::u_off);
#pragma unroll 1
    for (int qq = 0; qq < QW; ++qq) {
      const int pidx = (warp >> 2) + 4 * qq, m = (warp + qq) & 3;
      const int prod = pidx / NP, np = pidx % NP;
      const float* Bm = prod ? E1 : Ks;
      float c[2][4] = {};
      for (int kk = 0; kk < 2 * (m + 1); ++kk) {
        const int col = 8 * kk + tq;
        const float* Ta = Tm + (16 * m + gq) * LP + col;
        const uint32_t a[4] = {to_tf32(Ta[0]), to_tf32(Ta[8 * LP]), to_tf32(Ta[4]), to_tf32(Ta[8 * LP + 4])};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int ncol = 16 * np + 8 * nt + gq;
          const uint32_t bb[2] = {__float_as_uint(Bm[col * KP + ncol]), __float_as_uint(Bm[(col + 4) * KP + ncol])};
          mma_tf32(c[nt], a, bb);
        }
      }
      const int tok = 16 * m + gq;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col0 = 16 * np + 8 * nt + 2 * tq;
        if (prod == 0) {
          *reinterpret_cast<float2*>(wimg + tok * I::KPW + col0) = make_float2(tf32f(c[nt][0]), tf32f(c[nt][1]));
          *reinterpret_cast<float2*>(wimg + (tok + 8) * I::KPW + col0) =
              make_float2(tf32f(c[nt][2]), tf32f(c[nt][3]));
        } else {
          uimg[col0 * I::TP + tok] = c[nt][0];
          uimg[(col0 + 1) * I::TP + tok] = c[nt][1];
          uimg[col0 * I::TP + tok + 8] = c[nt][2];
          uimg[(col0 + 1) * I::TP + tok + 8] = c[nt][3];
        }
      }
    }
  }
}

// ---- 3. sequential pass over chunks ------------------------------------------------------------------------------
template <int K, typename StateT>
__global__ void __launch_bounds__(32 * kSeqWarps, 1)
    seq_kernel(const int32_t* __restrict__ cu, const int32_t* __restrict__ cs, const int32_t* __restrict__ slots,
               const char* __restrict__ imgs, StateT* __restrict__ pool, float* __restrict__ o, int64_t ld, int H) {
  using I = Img<K>;
  constexpr int NJ = K / 8;  // key n-tiles (TF32 k-steps over keys)
  unsigned char* smraw = dyn_smem<unsigned char>();
  uint64_t* bars = reinterpret_cast<uint64_t*>(smraw + 2 * I::stage_bytes(kBV));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
  const int vb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int c_beg = cs[b], nc = cs[b + 1] - c_beg;
  if (nc <= 0) return;  // empty sequence (or a workspace too small): the state stays as it was
  const int64_t t_beg = cu[b];
  const int len = cu[b + 1] - cu[b];
  const int v0 = vb * kBV, vw = v0 + 16 * warp;  // first value column of the CTA / of this warp

  if (tid == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  auto issue = [&](int c) {  // thread 0: chunk c's image into stage c & 1
    const int s = c & 1;
    const char* src = imgs + (size_t(c_beg + c) * H + h) * I::bytes;
    unsigned char* dst = smraw + s * I::stage_bytes(kBV);
    mbar_expect_tx(&bars[s], uint32_t(I::stage_bytes(kBV)));
    bulk_g2s(dst, src, uint32_t(I::shared_bytes), &bars[s]);
    bulk_g2s(dst + I::shared_bytes, src + I::u_off + size_t(v0) * I::TP * 4, uint32_t(I::u_slice_bytes(kBV)), &bars[s]);
  };
  if (tid == 0) {
    issue(0);
    if (nc > 1) issue(1);
  }

  // Sᵀ in accumulator layout: sa[j] = (value vw+g, key 8j+2t), (vw+g, 8j+2t+1), (vw+g+8, 8j+2t), (vw+g+8, 8j+2t+1).
  StateT* S = pool + (int64_t(slots[b]) * H + h) * K * K;  // [K key][K value]
  float sa[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int key = 8 * j + 2 * tq;
    sa[j][0] = load_state(S + key * K + vw + gq);
    sa[j][1] = load_state(S + (key + 1) * K + vw + gq);
    sa[j][2] = load_state(S + key * K + vw + gq + 8);
    sa[j][3] = load_state(S + (key + 1) * K + vw + gq + 8);
  }

#pragma unroll 1
  for (int c = 0; c < nc; ++c) {
    const int s = c & 1;
    while (!mbar_try_wait(&bars[s], uint32_t((c >> 1) & 1))) {
    }
    const unsigned char* st = smraw + s * I::stage_bytes(kBV);
    const float* Ws = reinterpret_cast<const float*>(st + I::w_off);
    const float* Kh = reinterpret_cast<const float*>(st + I::kh_off);
    const uint16_t* Qs = reinterpret_cast<const uint16_t*>(st + I::q_off);
    const uint16_t* Aq = reinterpret_cast<const uint16_t*>(st + I::a_off);
    const float* eG = reinterpret_cast<const float*>(st + I::e_off);
    const float* U0 = reinterpret_cast<const float*>(st + I::shared_bytes);  // [kBV values][TP]

    // v_newᵀ [16 values × 64 tokens] = U0ᵀ − Sᵀ·Wᵀ (TF32). k-step j covers keys 8j..8j+7 in the order
    // (2t, 2t+1) per lane: a = (−sa0, −sa2, −sa1, −sa3), b = W[token][8j+2t], W[token][8j+2t+1].
    float va[8][4];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const float2 lo = *reinterpret_cast<const float2*>(U0 + (16 * warp + gq) * I::TP + 8 * m + 2 * tq);
      const float2 hi = *reinterpret_cast<const float2*>(U0 + (16 * warp + gq + 8) * I::TP + 8 * m + 2 * tq);
      va[m][0] = lo.x;
      va[m][1] = lo.y;
      va[m][2] = hi.x;
      va[m][3] = hi.y;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const uint32_t a[4] = {to_tf32(-sa[j][0]), to_tf32(-sa[j][2]), to_tf32(-sa[j][1]), to_tf32(-sa[j][3])};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float2 w = *reinterpret_cast<const float2*>(Ws + (8 * m + gq) * I::KPW + 8 * j + 2 * tq);
        const uint32_t bb[2] = {__float_as_uint(w.x), __float_as_uint(w.y)};
        mma_tf32(va[m], a, bb);
      }
    }

    // oᵀ [16 values × 64 tokens] = Sᵀ·Q̃ᵀ + v_newᵀ·QKᵀ (BF16; accumulators map onto A fragments as they are).
    float oa[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(sa[2 * kk][0], sa[2 * kk][1]), pack_bf16(sa[2 * kk][2], sa[2 * kk][3]),
                             pack_bf16(sa[2 * kk + 1][0], sa[2 * kk + 1][1]),
                             pack_bf16(sa[2 * kk + 1][2], sa[2 * kk + 1][3])};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const uint16_t* qrow = Qs + (8 * m + gq) * I::KPQ + 16 * kk + 2 * tq;
        const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(qrow), *reinterpret_cast<const uint32_t*>(qrow + 8)};
        mma_bf16(oa[m], a, bb);
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pack_bf16(va[2 * kk][0], va[2 * kk][1]), pack_bf16(va[2 * kk][2], va[2 * kk][3]),
                             pack_bf16(va[2 * kk + 1][0], va[2 * kk + 1][1]),
                             pack_bf16(va[2 * kk + 1][2], va[2 * kk + 1][3])};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        if (16 * kk > 8 * m + 7) continue;  // QK[t][s] = 0 for s > t
        const uint16_t* arow = Aq + (8 * m + gq) * I::APQ + 16 * kk + 2 * tq;
        const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(arow), *reinterpret_cast<const uint32_t*>(arow + 8)};
        mma_bf16(oa[m], a, bb);
      }
    }
    {
      const int n = min(kC, len - kC * c);
      float* ob = o + (t_beg + int64_t(kC) * c) * ld + int64_t(h) * K + vw + gq;
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int tk = 8 * m + 2 * tq;
        if (tk < n) {
          ob[tk * ld] = oa[m][0];
          ob[tk * ld + 8] = oa[m][2];
        }
        if (tk + 1 < n) {
          ob[(tk + 1) * ld] = oa[m][1];
          ob[(tk + 1) * ld + 8] = oa[m][3];
        }
      }
    }

    // Sᵀ ← Sᵀ·diag(eG) + v_newᵀ·K̂ (TF32). k-step m covers tokens 8m..8m+7 in the order (2t, 2t+1) per lane.
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float2 e = *reinterpret_cast<const float2*>(eG + 8 * j + 2 * tq);
      sa[j][0] *= e.x;
      sa[j][1] *= e.y;
      sa[j][2] *= e.x;
      sa[j][3] *= e.y;
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const uint32_t a[4] = {to_tf32(va[m][0]), to_tf32(va[m][2]), to_tf32(va[m][1]), to_tf32(va[m][3])};
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float2 kh = *reinterpret_cast<const float2*>(Kh + (8 * j + gq) * I::TP + 8 * m + 2 * tq);
        const uint32_t bb[2] = {__float_as_uint(kh.x), __float_as_uint(kh.y)};
        mma_tf32(sa[j], a, bb);
      }
    }

    __syncthreads();  // both warps are done with stage s
    if (tid == 0 && c + 2 < nc) {
      fence_proxy_async();
      issue(c + 2);
    }
  }

#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int key = 8 * j + 2 * tq;
    store_state(S + key * K + vw + gq, sa[j][0]);
    store_state(S + (key + 1) * K + vw + gq, sa[j][1]);
    store_state(S + key * K + vw + gq + 8, sa[j][2]);
    store_state(S + (key + 1) * K + vw + gq + 8, sa[j][3]);
  }
}
}  // namespace

#ifndef KESTREL_SIMT_EMU

// ---- variant-1 launches ----------------------------------------------------------------------------------------
template <int K>
void launch_intra1(const ChunkArgs& a, cudaStream_t stream) {
  auto intra = intra_kernel<K>;
  KCUDA_CHECK(cudaFuncSetAttribute(intra, cudaFuncAttributeMaxDynamicSharedMemorySize, int(IntraSmem<K>::bytes)));
  intra<<<dim3(unsigned(a.cap), unsigned(a.H)), kIntraThreads, IntraSmem<K>::bytes, stream>>>(
      a.q, a.k, a.v, a.g, a.ld, a.beta, a.ld_beta, a.cu, a.cs, a.cseq, a.B, a.imgs, a.H);
  KCUDA_CHECK_LAUNCH();
}

template <int K, typename StateT>
void launch_seq1(const ChunkArgs& a, StateT* pool, cudaStream_t stream) {
  auto seq = seq_kernel<K, StateT>;
  const size_t smem = 2 * Img<K>::stage_bytes(kBV) + 16;
  KCUDA_CHECK(cudaFuncSetAttribute(seq, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  seq<<<dim3(unsigned(K / kBV), unsigned(a.H), unsigned(a.B)), 32 * kSeqWarps, smem, stream>>>(
      a.cu, a.cs, a.slots, a.imgs, pool, a.o, a.ld, a.H);
  KCUDA_CHECK_LAUNCH();
}

#define KDA_INSTANTIATE(K)                                                         \
  template void launch_intra1<K>(const ChunkArgs&, cudaStream_t);                  \
  template void launch_seq1<K, float>(const ChunkArgs&, float*, cudaStream_t);     \
  template void launch_seq1<K, uint16_t>(const ChunkArgs&, uint16_t*, cudaStream_t);
KDA_INSTANTIATE(32)
KDA_INSTANTIATE(64)
KDA_INSTANTIATE(128)
#undef KDA_INSTANTIATE

#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda::kda_detail
