// The MPI communicator against the in-process one, run by ctest as `mpirun -np N` (N = 2, 3).
//
// Every process builds the inputs of ALL ranks (a hash of rank, case and element), runs each
// collective once through MPI as its own rank, and once through an in-process group of N threads
// that play every rank; its MPI outputs must equal its in-process rank's outputs byte for byte. The
// reductions are also checked against a double-precision sum (relative 1e-6 for f32, one bf16 ulp),
// so two equal but wrong backends would still fail. Exit status 0 when every check passes; one line
// per failure otherwise (mpirun returns non-zero if any rank does).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "parallel/comm.h"
#include "parallel/inproc_comm.h"
#include "parallel/mpi_comm.h"

using namespace kestrel;
using namespace kestrel::parallel;

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Element e of rank r's buffer in case k: a float in (-4, 4) with a full mantissa, so sums round.
float value(int r, int k, size_t e) {
  const uint64_t h = mix((uint64_t(r) << 48) ^ (uint64_t(k) << 32) ^ e);
  return float(int64_t(h >> 11) % 8000000) * 5e-7f;
}

std::vector<uint8_t> make(int r, int k, size_t count, DType dt) {
  std::vector<uint8_t> b(count * dtype_size(dt));
  for (size_t e = 0; e < count; ++e) {
    const float v = value(r, k, e);
    if (dt == DType::f32) std::memcpy(b.data() + 4 * e, &v, 4);
    else {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(b.data() + 2 * e, &h, 2);
    }
  }
  return b;
}

float at(const std::vector<uint8_t>& b, size_t e, DType dt) {
  if (dt == DType::f32) {
    float v;
    std::memcpy(&v, b.data() + 4 * e, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * e, 2);
  return bf16_to_f32(h);
}

struct Outputs {
  std::vector<uint8_t> reduce, gather, scatter, bcast, a2a;
};

// Runs every collective of case k on comm c (inputs from make(), so every process can build them all).
Outputs run_case(Comm& c, int k, size_t count, DType dt) {
  const int n = c.size(), me = c.rank();
  const size_t esz = dtype_size(dt);
  Outputs o;
  o.reduce = make(me, k, count, dt);
  c.all_reduce_sum(o.reduce.data(), count, dt);
  const std::vector<uint8_t> mine = make(me, k, count, dt);
  o.gather.resize(count * esz * size_t(n));
  c.all_gather(mine.data(), o.gather.data(), count, dt);
  const std::vector<uint8_t> big = make(me, k + 1000, count * size_t(n), dt);
  o.scatter.resize(count * esz);
  c.reduce_scatter_sum(big.data(), o.scatter.data(), count, dt);
  o.bcast = make(me, k + 2000, count, dt);
  c.broadcast(o.bcast.data(), count, dt, (k + 1) % n);
  o.a2a.resize(big.size());
  c.all_to_all(big.data(), o.a2a.data(), count, dt);
  c.barrier();
  return o;
}

int failures = 0;
void check(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "FAIL %s\n", what.c_str());
}

}  // namespace

int main() {
  try {
    std::unique_ptr<Comm> world = mpi_world();
    const int n = world->size(), me = world->rank();
    const size_t counts[] = {0, 1, 3, 7, 1000, 4099};
    int k = 0, checks = 0;
    for (DType dt : {DType::f32, DType::bf16}) {
      for (size_t count : counts) {
        ++k;
        const Outputs got = run_case(*world, k, count, dt);
        std::vector<Outputs> want(static_cast<size_t>(n));
        run_ranks(n, [&](Comm& c) { want[size_t(c.rank())] = run_case(c, k, count, dt); });
        const Outputs& w = want[size_t(me)];
        const std::string tag = fmt::format("rank {} of {}, case {} ({} x {})", me, n, k, count, dtype_name(dt));
        check(got.reduce == w.reduce, tag + ": all_reduce_sum differs from the in-process bytes");
        check(got.gather == w.gather, tag + ": all_gather differs");
        check(got.scatter == w.scatter, tag + ": reduce_scatter_sum differs");
        check(got.bcast == w.bcast, tag + ": broadcast differs");
        check(got.a2a == w.a2a, tag + ": all_to_all differs");
        // Independent of both backends: the sums against double precision, the moves against the inputs.
        std::vector<std::vector<uint8_t>> ins, bigs;
        for (int r = 0; r < n; ++r) {
          ins.push_back(make(r, k, count, dt));
          bigs.push_back(make(r, k + 1000, count * size_t(n), dt));
        }
        const std::vector<uint8_t> root_in = make((k + 1) % n, k + 2000, count, dt);
        for (size_t e = 0; e < count; ++e) {
          double s = 0, rs = 0;
          for (int r = 0; r < n; ++r) {
            s += double(at(ins[size_t(r)], e, dt));
            rs += double(at(bigs[size_t(r)], size_t(me) * count + e, dt));
          }
          // f32: the rounding of n - 1 adds; bf16: one final rounding (half an ulp) plus those.
          auto tol = [&](double x) { return dt == DType::f32 ? 1e-6 * (std::fabs(x) + n) : std::ldexp(std::fabs(x), -8) + 1e-6; };
          check(std::fabs(double(at(got.reduce, e, dt)) - s) <= tol(s), tag + fmt::format(": sum at {} off", e));
          check(std::fabs(double(at(got.scatter, e, dt)) - rs) <= tol(rs), tag + fmt::format(": scatter at {} off", e));
          for (int p = 0; p < n; ++p) {
            check(at(got.gather, size_t(p) * count + e, dt) == at(ins[size_t(p)], e, dt), tag + ": gather block");
            check(at(got.a2a, size_t(p) * count + e, dt) == at(bigs[size_t(p)], size_t(me) * count + e, dt),
                  tag + ": all_to_all block");
          }
          check(at(got.bcast, e, dt) == at(root_in, e, dt), tag + ": broadcast");
        }
        checks += 5;
      }
    }
    world->barrier();
    if (me == 0) std::printf("mpi_comm_check: %d ranks, %d collective comparisons, %d failures\n", n, checks, failures);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
