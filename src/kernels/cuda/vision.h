// The MoonViT-V2 kernels of the GPU vision tower (MODEL.md §6; host driver src/vision/cuda). The linear
// layers and RMSNorms use the common launchers (gemm.h, norm.h, elementwise.h, rows.h); these are the
// vision-only pieces. CPU twins: src/vision/block.cpp (vision::attention, vision::rope_2d) and
// src/vision/projector.cpp (GELU); tests tests/gpu/test_vision_gpu.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// Full (non-causal) attention of every image with itself, on tensor cores (mma.sync m16n8k16 BF16,
// FP32 accumulation, flash-style online softmax). Image i owns rows [row0[i], row0[i+1]) of qkv; row r
// holds [q | k | v], each Hv heads × head_dim, starting at r·ld, k at +Wq, v at +2·Wq. o row r, head h
// = softmax(q kᵀ · head_dim^−½) v, rounded to BF16. head_dim ∈ {16, 32, 128} (64
// spilled 12 bytes at ptxas's register choice; add it with a look at -Xptxas -v); ld, Wq multiples of 8;
// qkv 16-byte aligned. max_rows ≥ every image's row count (sizes the grid).
// Numerics: the probabilities enter the P·V product as BF16 (as every flash kernel does); the CPU twin
// keeps them FP32, so the two differ by ~1e-3 relative (tests/gpu/test_vision_gpu.cpp states the bound).
void vision_attention(const uint16_t* qkv /* bf16 [ΣN, 3, Hv, dv], row stride ld */, int64_t ld, int64_t Wq,
                      const int32_t* row0 /* device i32 [n_images + 1] */, int n_images, int64_t max_rows,
                      int heads, int head_dim, uint16_t* o /* bf16 [ΣN, Hv·dv], row stride ldo */, int64_t ldo,
                      cudaStream_t stream);

// 2-D RoPE (§6) of q and k in place: pair j of a head (elements 2j, 2j+1) turns by col·f_{j/2} (j even)
// or row·f_{j/2} (j odd), f_i = 10000^(−4i/head_dim); (row, col) of row t = rc[2t], rc[2t+1].
void vision_rope_qk(uint16_t* qkv /* bf16 [T, 3, Hv, dv], row stride ld */, int64_t ld, int64_t Wq,
                    const int32_t* rc /* device i32 [T, 2] */, int64_t T, int heads, int head_dim,
                    cudaStream_t stream);

// In place: x = bf16(gelu_tanh(x)) (`gelu_pytorch_tanh`), x = bf16(gelu_erf(x)) (exact GELU).
void gelu_tanh_bf16(uint16_t* x /* bf16 [n] */, int64_t n, cudaStream_t stream);
void gelu_erf_bf16(uint16_t* x /* bf16 [n] */, int64_t n, cudaStream_t stream);

}  // namespace kestrel::cuda
