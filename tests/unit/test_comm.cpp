// The in-process communicator (parallel/inproc_comm.h): every collective against results written
// out by hand, the reduction's order and single rounding, identical bytes on every rank, and the
// failure paths (mismatched calls, a rank that throws) ending in an Error instead of a hang.
// The MPI communicator is checked against this one by tests/unit/mpi/mpi_comm_check.cpp under mpirun.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "parallel/comm.h"
#include "parallel/inproc_comm.h"

namespace kestrel::parallel {
namespace {

// Rank r's value for element i: small integers and halves, exact in f32 and bf16, so sums are exact.
float val(int r, size_t i) { return float(int(i % 13) - 6) * 0.5f + float(r * 3 + 1); }

TEST(InProcessComm, AllReduceF32EqualsHandSumOnEveryRank) {
  for (int n : {1, 2, 3, 4, 7}) {
    const size_t count = 37;
    std::vector<std::vector<float>> got(static_cast<size_t>(n));
    run_ranks(n, [&](Comm& c) {
      EXPECT_EQ(c.size(), n);
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = val(c.rank(), i);
      c.all_reduce_sum(buf.data(), count, DType::f32);
      got[size_t(c.rank())] = buf;
    });
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += val(r, i);
      for (int r = 0; r < n; ++r) EXPECT_EQ(got[size_t(r)][i], want) << "n " << n << " rank " << r << " i " << i;
    }
  }
}

TEST(InProcessComm, Bf16SumAccumulatesInF32AndRoundsOnce) {
  // 1 + 2^-8 + 2^-8: rounding to bf16 after each add gives 1 (each 2^-8 is half an ulp and ties to
  // even); one rounding at the end gives 1 + 2^-7, which bf16 represents exactly.
  const float parts[3] = {1.0f, 0.00390625f, 0.00390625f};
  std::vector<uint16_t> got(3);
  run_ranks(3, [&](Comm& c) {
    uint16_t x = f32_to_bf16(parts[c.rank()]);
    c.all_reduce_sum(&x, 1, DType::bf16);
    got[size_t(c.rank())] = x;
  });
  for (uint16_t g : got) EXPECT_EQ(bf16_to_f32(g), 1.0078125f);
}

TEST(InProcessComm, SumRunsInRankOrder) {
  // (1e8 + 1) - 1e8 = 0 in f32 (1 is below half an ulp of 1e8); any order that adds 1 last gives 1.
  const float parts[3] = {1e8f, 1.0f, -1e8f};
  std::vector<float> got(3);
  run_ranks(3, [&](Comm& c) {
    float x = parts[c.rank()];
    c.all_reduce_sum(&x, 1, DType::f32);
    got[size_t(c.rank())] = x;
  });
  for (float g : got) EXPECT_EQ(g, 0.0f);
  // -0 + -0 stays -0 (the sum starts from rank 0's value, not from +0).
  run_ranks(2, [&](Comm& c) {
    float x = -0.0f;
    c.all_reduce_sum(&x, 1, DType::f32);
    EXPECT_TRUE(std::signbit(x));
  });
}

TEST(InProcessComm, AllGatherReduceScatterBroadcastAllToAll) {
  const int n = 3;
  const size_t count = 5;
  run_ranks(n, [&](Comm& c) {
    const int me = c.rank();
    // all_gather: block p = rank p's values.
    std::vector<float> send(count), recv(count * n);
    for (size_t i = 0; i < count; ++i) send[i] = val(me, i);
    c.all_gather(send.data(), recv.data(), count, DType::f32);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(recv[size_t(p) * count + i], val(p, i));

    // reduce_scatter: rank me gets Σ_p (block me of rank p's buffer).
    std::vector<float> rs_send(count * n), rs_recv(count);
    for (size_t j = 0; j < rs_send.size(); ++j) rs_send[j] = val(me, j) * 2.0f;
    c.reduce_scatter_sum(rs_send.data(), rs_recv.data(), count, DType::f32);
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int p = 0; p < n; ++p) want += val(p, size_t(me) * count + i) * 2.0f;
      EXPECT_EQ(rs_recv[i], want);
    }

    // broadcast from every root, bf16 (any dtype moves as raw elements).
    for (int root = 0; root < n; ++root) {
      std::vector<uint16_t> b(count);
      for (size_t i = 0; i < count; ++i) b[i] = uint16_t(1000 * me + i);
      c.broadcast(b.data(), count, DType::bf16, root);
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(b[i], uint16_t(1000 * root + i));
    }

    // all_to_all: block p of my send goes to rank p; block p of my recv came from rank p.
    std::vector<int32_t> a_send(count * n), a_recv(count * n);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) a_send[size_t(p) * count + i] = 10000 * me + 100 * p + int(i);
    c.all_to_all(a_send.data(), a_recv.data(), count, DType::i32);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(a_recv[size_t(p) * count + i], 10000 * p + 100 * me + int(i));
  });
}

TEST(InProcessComm, InPlaceAllGatherAndZeroCounts) {
  const int n = 4;
  const size_t count = 3;
  run_ranks(n, [&](Comm& c) {
    std::vector<float> buf(count * n, -1.0f);
    for (size_t i = 0; i < count; ++i) buf[size_t(c.rank()) * count + i] = val(c.rank(), i);
    c.all_gather(buf.data() + size_t(c.rank()) * count, buf.data(), count, DType::f32);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(buf[size_t(p) * count + i], val(p, i));
    c.all_reduce_sum(nullptr, 0, DType::bf16);
    c.all_gather(nullptr, nullptr, 0, DType::f32);
  });
}

TEST(InProcessComm, BarrierWaitsForEveryRank) {
  const int n = 5;
  std::atomic<int> arrived{0};
  run_ranks(n, [&](Comm& c) {
    for (int round = 1; round <= 20; ++round) {
      arrived.fetch_add(1);
      c.barrier();
      EXPECT_GE(arrived.load(), round * n);
      c.barrier();  // nobody starts the next round before everyone checked this one
    }
  });
}

TEST(InProcessComm, MismatchedCallsThrowOnEveryRankInsteadOfHanging) {
  std::atomic<int> threw{0};
  try {
    run_ranks(3, [&](Comm& c) {
      std::vector<float> buf(8, 1.0f);
      try {
        c.all_reduce_sum(buf.data(), c.rank() == 2 ? 7 : 8, DType::f32);
      } catch (const Error&) {
        threw.fetch_add(1);
        throw;
      }
    });
    FAIL() << "a mismatch was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(threw.load(), 3);
}

TEST(InProcessComm, AFailingRankAbortsTheOthersAndItsErrorIsReported) {
  try {
    run_ranks(4, [&](Comm& c) {
      if (c.rank() == 1) throw Error("rank one broke");
      std::vector<float> buf(4, 1.0f);
      for (int i = 0; i < 3; ++i) c.all_reduce_sum(buf.data(), buf.size(), DType::f32);
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank one broke");
  }
}

TEST(InProcessComm, RejectsDtypesReductionsDoNotSupport) {
  EXPECT_THROW(run_ranks(2,
                         [&](Comm& c) {
                           int32_t x = 1;
                           c.all_reduce_sum(&x, 1, DType::i32);
                         }),
               Error);
  EXPECT_THROW(InProcessGroup(0), Error);
}

}  // namespace
}  // namespace kestrel::parallel
