// One-shot all-reduce for decode-sized messages (a few KB to ~1 MB) over buffers every rank can
// address (CUDA IPC across processes, plain device pointers in the emulation): docs/parallel.md,
// "Custom all-reduce". Anchor: 3.5-5.2 µs for 16 KB across 8 H200s against ~18 µs for NCCL.
//
// Protocol, per call, with G blocks per rank (G fixed for the buffers' lifetime, so every call uses
// every block) and the call's epoch e = 1, 2, 3, ... (a counter per block in device memory, advanced
// by the kernel itself, so a captured CUDA graph replays correctly):
//   1. block b of rank r copies part b of the input into data[r], half (e & 1);
//   2. it raises flags[p][b][r] = e on every rank p (fence + st.release.sys);
//   3. it waits until flags[r][b][p] >= e for every p (ld.acquire.sys; wrap-aware compare);
//   4. it sums part b of data[0..n-1] half (e & 1) in rank order in f32 and writes the output.
// Every rank cuts the message into the same G parts, so block b only waits for the blocks b of its
// peers. No end barrier is needed: a rank writes half (e & 1) again only in call e + 2, which starts
// after its call e + 1 saw every peer publish e + 1, i.e. after every peer's call-e kernel (the last
// reader of that half) finished on its stream. A peer may already have raised e + 1 in a flag this
// rank waits on for e, hence ">=". Calls may change the message size: all blocks share one epoch,
// and consecutive calls use opposite halves.
// The sum is the host backends' (parallel/comm.h sum_in_rank_order): rank order, f32 accumulation,
// one RNE rounding, so the result equals the CPU twin's bytes exactly.
// Deadlock freedom needs each rank's G blocks resident together with their peers' (G is small,
// <= 64); a wait is bounded: after 10 s without a peer the kernel traps (a launch error, not a hang).
// CPU twin: kestrel::parallel::sum_in_rank_order; tests: tests/gpu/test_allreduce_gpu.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

inline constexpr int kOneShotMaxRanks = 16;
inline constexpr int kOneShotMaxBlocks = 64;
// Control words of one rank, zeroed before first use: u32 flags [kOneShotMaxBlocks, kOneShotMaxRanks]
// (slot [b][p] written by rank p), then u32 epochs [kOneShotMaxBlocks] (this rank's own counters).
inline constexpr size_t kOneShotFlagWords = size_t(kOneShotMaxBlocks) * (kOneShotMaxRanks + 1);
inline constexpr size_t kOneShotFlagBytes = kOneShotFlagWords * sizeof(uint32_t);
// The flags rounded up to 256 bytes: a rank's buffer is [control | data], and the data stays 256-byte aligned.
inline constexpr size_t kOneShotControlBytes = (kOneShotFlagBytes + 255) / 256 * 256;

struct OneShotBuffers {
  int n = 0;                                // ranks
  int blocks = 0;                           // G, the same for every call and rank, <= kOneShotMaxBlocks
  size_t half_bytes = 0;                    // largest message; each data buffer holds two halves
  void* data[kOneShotMaxRanks] = {};        // u8 [2, half_bytes] of rank p, 16-byte aligned
  uint32_t* flags[kOneShotMaxRanks] = {};   // u32 [kOneShotFlagWords] of rank p
};

// This process is rank `rank`: out (dt [count]) = Σ_p in_p. in and out are this rank's device
// buffers (may alias), 16-byte aligned; count · size(dt) must be a multiple of 16 and at most
// half_bytes. bf16 selects bf16 elements, otherwise f32. Every rank must make the same calls.
void one_shot_all_reduce(const OneShotBuffers& b, int rank, const void* in, void* out, size_t count, bool bf16,
                         cudaStream_t stream);

// All n ranks on this one device in one cooperative launch (blockIdx.y = rank): in[p], out[p] are
// rank p's buffers. The same kernel body as above; used to test the protocol on a single GPU.
// Throws if n · blocks blocks cannot be resident at once.
void one_shot_all_reduce_emulated(const OneShotBuffers& b, const void* const* in, void* const* out, size_t count,
                                  bool bf16, cudaStream_t stream);

// A good G for messages up to `bytes`: one block per 16 KB (256 threads x 16 B x 4 passes), between 4 and
// kOneShotMaxBlocks.
int one_shot_blocks(size_t bytes);

}  // namespace kestrel::cuda
