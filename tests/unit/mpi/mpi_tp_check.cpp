// The tensor-parallel CPU twin as processes (issue #16 point 4), run by ctest as `mpirun -np 2`: each
// process is one rank of nano at TP2 (and then EP2) behind the MPI communicator — prefill of an
// 80-token prompt (past the indexer's top-k) and 4 decodes of TP1's greedy tokens — and must produce, byte for byte,
// what the same rank produces when the two ranks are threads of one process behind the in-process
// communicator (both backends reduce in rank order, comm.h). Every process also checks its logits
// against TP1's (BF16 tolerance), so two equal but wrong backends would still fail. Exit status 0
// when every check passes; one line per failure otherwise.
#include <cmath>
#include <cstdio>

#include "parallel/mpi_comm.h"
#include "../tp_run.h"

using namespace kestrel;

namespace {

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, double(std::fabs(a[i] - b[i]))), m = std::max(m, double(std::fabs(a[i])));
  return m > 0 ? d / m : d;
}

}  // namespace

int main() {
  int failures = 0;
  try {
    auto world = parallel::mpi_world();
    const int r = world->rank();
    if (world->size() != 2) {
      std::fprintf(stderr, "run me as mpirun -np 2 (got %d ranks)\n", world->size());
      return 2;
    }
    const testing::Ckpt& ck = testing::checkpoint("nano");
    const std::vector<int32_t> prompt = testing::random_prompt(80, 11);
    const int steps = 4;
    const testing::RankRun one = testing::run_layout(ck, ParallelLayout{}, prompt, steps)[0];
    for (bool ep : {false, true}) {
      ParallelLayout p;
      p.tp = 2;
      p.expert_parallel = ep;
      // Both decode TP1's greedy tokens (teacher forcing: a near-tie cannot send them elsewhere).
      const testing::RankRun mpi = testing::run_rank(ck, p, *world, prompt, steps, one.tokens);
      const testing::RankRun threads = testing::run_layout(ck, p, prompt, steps, one.tokens)[size_t(r)];
      auto check = [&](bool ok, const char* what) {
        if (!ok) {
          std::printf("rank %d %s: %s\n", r, p.name().c_str(), what);
          ++failures;
        }
      };
      check(mpi.prefill == threads.prefill, "prefill logits differ from the in-process rank's");
      check(mpi.decode == threads.decode, "decode logits differ from the in-process rank's");
      check(mpi.tokens == threads.tokens, "greedy tokens differ from the in-process rank's");
      check(rel_diff(one.prefill, mpi.prefill) < 2e-2, "prefill logits further than BF16 noise from TP1's");
      for (int s = 0; s < steps; ++s)
        check(rel_diff(one.decode[size_t(s)], mpi.decode[size_t(s)]) < 2e-2, "decode logits further than BF16 noise from TP1's");
      if (r == 0) std::printf("%s over MPI: %zu prefill + %d decode logit rows equal the in-process run\n",
                              p.name().c_str(), prompt.size(), steps);
    }
    world->barrier();
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
