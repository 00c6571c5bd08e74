// Device collectives on one GPU (issue #16): the one-shot all-reduce (kernels/cuda/allreduce.h) against
// the CPU twin's sum (parallel::sum_in_rank_order), bit for bit, with 2-8 ranks emulated on this device
// in one cooperative launch; the same kernel in its real (one rank per process) form at world size 1,
// through IpcAllReduce and inside a CUDA graph; and the NCCL communicator at world size 1 against the
// in-process one. Filter: --gtest_filter='GpuAllReduce.*:GpuNccl.*'.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "core/check.h"
#include "harness.h"
#include "kernels/cuda/allreduce.h"
#include "kernels/cuda/cuda_check.h"
#include "parallel/comm.h"
#include "parallel/inproc_comm.h"
#include "parallel/ipc_allreduce.h"
#include "parallel/nccl_comm.h"

namespace kestrel::gputest {
namespace {

// n ranks' exchange buffers on this device, zeroed control words.
struct Emulated {
  std::vector<cuda::DeviceBuffer> mem;
  cuda::OneShotBuffers b;
  Emulated(int n, size_t max_bytes) {
    b.n = n;
    b.half_bytes = max_bytes;
    b.blocks = cuda::one_shot_blocks(max_bytes);
    for (int p = 0; p < n; ++p) {
      mem.emplace_back(cuda::kOneShotFlagBytes + 256 + 2 * max_bytes);
      KCUDA_CHECK(cudaMemset(mem.back().data(), 0, cuda::kOneShotFlagBytes));
      b.flags[p] = static_cast<uint32_t*>(mem.back().data());
      b.data[p] = static_cast<char*>(mem.back().data()) + (cuda::kOneShotFlagBytes + 255) / 256 * 256;
    }
  }
};

// Rank inputs with full mantissas (so the f32 sum rounds and the order matters), as raw bytes.
std::vector<std::vector<uint8_t>> rank_inputs(int n, size_t count, bool bf16, uint64_t seed) {
  Rng r(seed);
  std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n));
  for (auto& v : in) {
    v.resize(count * (bf16 ? 2 : 4));
    for (size_t i = 0; i < count; ++i) {
      const float x = r.uniform(-3.0f, 3.0f) * (i % 97 == 0 ? 1e4f : 1.0f);
      if (bf16) {
        const uint16_t h = f32_to_bf16(x);
        std::memcpy(v.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(v.data() + 4 * i, &x, 4);
      }
    }
  }
  return in;
}

std::vector<uint8_t> twin_sum(const std::vector<std::vector<uint8_t>>& in, size_t count, bool bf16) {
  std::vector<const void*> parts;
  for (const auto& v : in) parts.push_back(v.data());
  std::vector<uint8_t> out(count * (bf16 ? 2 : 4));
  parallel::sum_in_rank_order(parts.data(), int(parts.size()), out.data(), count, bf16 ? DType::bf16 : DType::f32);
  return out;
}

TEST(GpuAllReduce, OneShotEmulatedRanksEqualTheCpuTwinBitForBit) {
  // Counts: 16 B, one token of hidden 256 (nano), one token of 7168, 8 tokens, 64 tokens (bf16) — the
  // decode-sized messages — and an odd number of 16-byte vectors.
  const size_t max_bytes = 64 * 7168 * 2;
  for (int n : {2, 3, 4, 8}) {
    Emulated em(n, max_bytes);
    uint64_t seed = 100 * uint64_t(n);
    // Several calls in a row on the same buffers: the epoch advances and the halves alternate.
    for (bool bf16 : {true, false, true}) {
      for (size_t tokens_x_d : {size_t(bf16 ? 8 : 4), size_t(256), size_t(7168), size_t(8 * 7168), size_t(1000 * 8 + 8),
                                size_t(bf16 ? 64 * 7168 : 32 * 7168)}) {
        const size_t count = tokens_x_d;
        const auto in = rank_inputs(n, count, bf16, ++seed);
        std::vector<cuda::DeviceBuffer> din, dout;
        std::vector<const void*> ip;
        std::vector<void*> op;
        for (int p = 0; p < n; ++p) {
          din.emplace_back(in[size_t(p)].size());
          din.back().copy_from_host(in[size_t(p)].data(), in[size_t(p)].size());
          dout.emplace_back(in[size_t(p)].size());
          KCUDA_CHECK(cudaMemset(dout.back().data(), 0xFF, in[size_t(p)].size()));
          ip.push_back(din.back().data());
          op.push_back(dout.back().data());
        }
        cuda::one_shot_all_reduce_emulated(em.b, ip.data(), op.data(), count, bf16, nullptr);
        sync();
        const std::vector<uint8_t> want = twin_sum(in, count, bf16);
        for (int p = 0; p < n; ++p) {
          std::vector<uint8_t> got(want.size());
          dout[size_t(p)].copy_to_host(got.data(), got.size());
          check_exact("one_shot_all_reduce (emulated)",
                      fmt::format("n={} rank {} count {} {}", n, p, count, bf16 ? "bf16" : "f32"), got.data(),
                      want.data(), want.size());
        }
      }
    }
  }
}

TEST(GpuAllReduce, OneShotInPlaceAtWorldSizeOneAndUnderGraphReplay) {
  // The real-mode launcher (one rank per process) at n = 1: out = in exactly, in place, and captured in
  // a CUDA graph whose replays advance the device-side epoch (a host epoch would be frozen in the graph).
  parallel::run_ranks(1, [&](parallel::Comm& boot) {
    parallel::IpcAllReduce ar(boot, 7168 * 2 * 8);
    ASSERT_TRUE(ar.supports(7168, DType::bf16));
    ASSERT_FALSE(ar.supports(7, DType::bf16));
    ASSERT_FALSE(ar.supports(7168 * 9, DType::bf16));
    cudaStream_t s;
    KCUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const auto in = rank_inputs(1, 7168 * 8, true, 7);
    cuda::DeviceBuffer buf(in[0].size());
    for (int call = 0; call < 3; ++call) {
      buf.copy_from_host(in[0].data(), in[0].size());
      ar.all_reduce_sum(buf.data(), 7168 * 8, DType::bf16, s);
      KCUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<uint8_t> got(in[0].size());
      buf.copy_to_host(got.data(), got.size());
      check_exact("IpcAllReduce n=1", fmt::format("call {}", call), got.data(), in[0].data(), got.size());
    }
    cudaGraph_t g;
    cudaGraphExec_t ge;
    KCUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    ar.all_reduce_sum(buf.data(), 7168, DType::bf16, s);
    KCUDA_CHECK(cudaStreamEndCapture(s, &g));
    KCUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int replay = 0; replay < 3; ++replay) {
      const auto x = rank_inputs(1, 7168, true, 50 + uint64_t(replay));
      buf.copy_from_host(x[0].data(), x[0].size());
      KCUDA_CHECK(cudaGraphLaunch(ge, s));
      KCUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<uint8_t> got(x[0].size());
      buf.copy_to_host(got.data(), got.size());
      check_exact("IpcAllReduce n=1 graph replay", fmt::format("replay {}", replay), got.data(), x[0].data(),
                  got.size());
    }
    KCUDA_CHECK(cudaGraphExecDestroy(ge));
    KCUDA_CHECK(cudaGraphDestroy(g));
    KCUDA_CHECK(cudaStreamDestroy(s));
  });
}

TEST(GpuNccl, WorldSizeOneMatchesTheInProcessComm) {
  if (!parallel::nccl_compiled()) GTEST_SKIP() << "built without nccl.h";
  note("NCCL " + parallel::nccl_version());
  const size_t count = 7168 * 4;
  const auto in = rank_inputs(1, count, false, 11);
  const auto inb = rank_inputs(1, count, true, 12);
  // Expected: the in-process comm at world size 1 over the same bytes.
  std::vector<uint8_t> w_ar = in[0], w_arb = inb[0], w_ag(in[0].size()), w_rs(in[0].size()), w_bc = inb[0],
                       w_a2a(in[0].size());
  parallel::run_ranks(1, [&](parallel::Comm& c) {
    c.all_reduce_sum(w_ar.data(), count, DType::f32);
    c.all_reduce_sum(w_arb.data(), count, DType::bf16);
    c.all_gather(in[0].data(), w_ag.data(), count, DType::f32);
    c.reduce_scatter_sum(in[0].data(), w_rs.data(), count, DType::f32);
    c.broadcast(w_bc.data(), count, DType::bf16, 0);
    c.all_to_all(in[0].data(), w_a2a.data(), count, DType::f32);
  });
  parallel::run_ranks(1, [&](parallel::Comm& boot) {
    cudaStream_t s;
    KCUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      std::unique_ptr<parallel::Comm> nc = parallel::nccl_comm(boot, 0, s);
      EXPECT_EQ(nc->rank(), 0);
      EXPECT_EQ(nc->size(), 1);
      EXPECT_EQ(nc->device(), Device::cuda);
      cuda::DeviceBuffer a(in[0].size()), ab(inb[0].size()), src(in[0].size()), out(in[0].size());
      a.copy_from_host(in[0].data(), in[0].size());
      ab.copy_from_host(inb[0].data(), inb[0].size());
      src.copy_from_host(in[0].data(), in[0].size());
      // The poison goes on s, the comm's stream: s is non-blocking, so a cudaMemset on the legacy stream is not
      // ordered with the collective and could land after it (it did once, with another process loading the GPU).
      auto expect = [&](const cuda::DeviceBuffer& d, const std::vector<uint8_t>& want, const char* what) {
        KCUDA_CHECK(cudaStreamSynchronize(s));
        std::vector<uint8_t> got(want.size());
        d.copy_to_host(got.data(), got.size());
        check_exact(what, "world size 1", got.data(), want.data(), want.size());
      };
      nc->all_reduce_sum(a.data(), count, DType::f32);
      expect(a, w_ar, "nccl all_reduce_sum f32");
      nc->all_reduce_sum(ab.data(), count, DType::bf16);
      expect(ab, w_arb, "nccl all_reduce_sum bf16");
      KCUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.size(), s));
      nc->all_gather(src.data(), out.data(), count, DType::f32);
      expect(out, w_ag, "nccl all_gather");
      KCUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.size(), s));
      nc->reduce_scatter_sum(src.data(), out.data(), count, DType::f32);
      expect(out, w_rs, "nccl reduce_scatter_sum");
      ab.copy_from_host(inb[0].data(), inb[0].size());
      nc->broadcast(ab.data(), count, DType::bf16, 0);
      expect(ab, w_bc, "nccl broadcast");
      KCUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.size(), s));
      nc->all_to_all(src.data(), out.data(), count, DType::f32);
      expect(out, w_a2a, "nccl all_to_all");
      nc->barrier();
      EXPECT_THROW(nc->all_reduce_sum(a.data(), count, DType::i32), Error);
    }
    KCUDA_CHECK(cudaStreamDestroy(s));
  });
}

}  // namespace
}  // namespace kestrel::gputest
