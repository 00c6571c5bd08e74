// MLA attention core (MODEL.md §3.4 step 4, both forms) and the DSA indexer's key norm and selection
// (§3.5 steps 2, 5, 6) on the CPU. Factored out of model/mla.cpp and model/indexer.cpp line for line,
// so the layer code and the GPU op tests (tests/gpu) use one version as the oracle.
#pragma once

#include <cstdint>

namespace kestrel::cpu {

// Shapes of one MLA layer's attention core (MODEL.md Appendix A: nano 4/32/16/32/64, mini 12/128/64/128/512).
struct MlaDims {
  int64_t Hm, N, R, Dv, C;  // heads, nope, rope, v, kv_lora
  int64_t qk() const { return N + R; }
  int64_t cw() const { return C + R; }  // latent cache row width (576 at full size)
};

// Query t sits at position pos0 + t; it attends to sel[t, 0..] (ascending, −1 ends the list) when sel is
// non-null, else to 0..pos0+t. Scores (q·k)·(N+R)^−½ and softmax in FP32; each head's output is rounded
// to BF16 (the attention op's output dtype).
//  naive: k_h,j = [k_nope,h,j | k_pe,j], v_h,j from kv = Lin(kv_b_proj)(ĉ) (bf16 [S, Hm, N+Dv]).
//  absorbed: q̃_h = W_UK,hᵀ q_nope,h (FP32), scores over the latent rows, ô_h = Σ p_j ĉ_j, o_h = W_UV,h ô_h.
void mla_attn_naive(const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */,
                    const uint16_t* kv /* bf16 [S, Hm, N+Dv] */, const uint16_t* latent /* bf16 [S, C+R] */,
                    const int32_t* sel /* i32 [T, Ksel] or null */, int64_t Ksel, int64_t T, int64_t pos0,
                    uint16_t* o /* bf16 [T, Hm*Dv] */);
void mla_attn_absorbed(const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */,
                       const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C], per head [W_UK | W_UV] */,
                       const uint16_t* latent /* bf16 [S, C+R] */, const int32_t* sel /* i32 [T, Ksel] or null */,
                       int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o /* bf16 [T, Hm*Dv] */);

// k_I = LayerNorm_{eps 1e-6}(kraw) with weight and optional bias (null = 0): mean and variance in double,
// one BF16 rounding.
void indexer_key_norm(const uint16_t* kraw /* bf16 [T, Di] */, const uint16_t* w /* bf16 [Di] */,
                      const uint16_t* b /* bf16 [Di] or null */, int64_t T, int64_t Di, uint16_t* out /* bf16 [T, Di] */);

// sel[t] = the positions of the Ki largest I[t, s] = Σ_h (w[t,h]·(Hi·Di)^−½)·ReLU(q_I[t,h]·k_I[s]) over
// s ≤ pos0+t, ties to the lower position, handed back ascending and −1 padded; all visible positions when
// there are at most Ki. Every dot product and the head sum run sequentially in FP32 (the order is part
// of the contract: the GPU kernel repeats it, so both select the same keys bit for bit).
void indexer_select_topk(const uint16_t* qi /* bf16 [T, Hi*Di] */, const uint16_t* keys /* bf16 [S, Di] */,
                         const float* hw /* f32 [T, Hi] */, int64_t T, int64_t pos0, int64_t Hi, int64_t Di, int64_t Ki,
                         int32_t* sel /* i32 [T, Ki] */);

// ---- The CPU engine's versions (mla_fast.cpp, indexer_fast.cpp) ----------------------------------

// mla_attn_absorbed vectorised (AVX2; the twin without it): the same inputs and outputs, except that
// `latent` may be any row set — with a selection, sel holds row indices into it (ascending, −1 ends a
// list); without, query t reads rows 0..pos0+t. FP32 rounding noise from the twin (tests bound it).
// It is the three stages below in a row; the model runs the token-local first and last stages over
// all sequences of a step at once.
void mla_q_latent(const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */, const uint16_t* kv_b,
                  int64_t T, float* qt /* f32 [T, Hm, C+R]: W_UKᵀ q_nope | q_pe */);
void mla_attn_latent_fast(const MlaDims& d, const float* qt /* f32 [T, Hm, C+R] */,
                          const uint16_t* latent /* bf16 [rows, C+R] */, const int32_t* sel /* i32 [T, Ksel] or null */,
                          int64_t Ksel, int64_t T, int64_t pos0, float* ohat /* f32 [T, Hm, C] */);  // AVX2 only
// The AVX2 kernel one (query, head) pair at a time, serially: mla_attn_latent_fast's per-head
// arithmetic without its four-head sharing, kept as the bit-exact reference its test compares with.
void mla_attn_latent_pairs(const MlaDims& d, const float* qt /* f32 [T, Hm, C+R] */,
                           const uint16_t* latent /* bf16 [rows, C+R] */, const int32_t* sel /* i32 [T, Ksel] or null */,
                           int64_t Ksel, int64_t T, int64_t pos0, float* ohat /* f32 [T, Hm, C] */);  // AVX2 only
// Its AVX-512 form (mla_avx512.cpp), which mla_attn_latent_fast runs on avx512bf16 CPUs: a query's
// heads share each widened latent row; another FP32 summation order, the same contract.
void mla_attn_latent_avx512(const MlaDims& d, const float* qt /* f32 [T, Hm, C+R] */,
                            const uint16_t* latent /* bf16 [rows, C+R] */, const int32_t* sel /* i32 [T, Ksel] or null */,
                            int64_t Ksel, int64_t T, int64_t pos0, float* ohat /* f32 [T, Hm, C] */);
void mla_o_latent(const MlaDims& d, const float* ohat /* f32 [T, Hm, C] */, const uint16_t* kv_b, int64_t T,
                  uint16_t* o /* bf16 [T, Hm*Dv] */);
void mla_attn_absorbed_fast(const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */,
                            const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, const uint16_t* latent /* bf16 [rows, C+R] */,
                            const int32_t* sel /* i32 [T, Ksel] or null */, int64_t Ksel, int64_t T, int64_t pos0,
                            uint16_t* o /* bf16 [T, Hm*Dv] */);

// indexer_select_topk, vectorised and with an O(n) selection: bit-identical output (same scores in
// the same order, same ties), any T.
void indexer_select_topk_fast(const uint16_t* qi /* bf16 [T, Hi*Di] */, const uint16_t* keys /* bf16 [S, Di] */,
                              const float* hw /* f32 [T, Hi] */, int64_t T, int64_t pos0, int64_t Hi, int64_t Di,
                              int64_t Ki, int32_t* sel /* i32 [T, Ki] */);

// The positions of the k largest of x[0..n), ascending: exactly cpu::topk followed by a sort (ties to
// the lower index, NaN with −inf below every number), by radix select in O(n).
void topk_sorted(const float* x /* f32 [n] */, int64_t n, int64_t k, int32_t* idx /* i32 [k] */);

}  // namespace kestrel::cpu
