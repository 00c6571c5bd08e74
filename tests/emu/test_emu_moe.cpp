// The routed-MoE expert kernels (src/kernels/cuda/moe_experts.cu's prep and grouping kernels, moe_t8.cu's fixed-grid
// t8 / t32 GEMMs, moe_t8p.cu's persistent w1|w3 and w2, moe_combine.cu's combine and combine + RMSNorm, one CTA or
// one cluster a token) on the CPU emulation of simt.h, against the CPU twins cpu::moe_experts, cpu::mxfp4_gemm and
// cpu::rmsnorm_bf16 with the tolerances of tests/gpu/test_moe_gpu.cpp, and bit-identical where the GPU test asks that
// of two variants (K halves and the fixed grid's split 2, the persistent and fixed grids at one split, w2's raw decode
// and its FP32 scales, the fused norm's ũ and the plain combine's, the cluster combine's ũ and the one-CTA one's). This catches index, layout, split-K, work-list and barrier mistakes in
// CI, where no GPU exists; tests/gpu adds the real tensor cores, programmatic dependent launch and timing.
//
// What runs is what the GPU would run: the launchers themselves (moe_experts_mxfp4, mxfp4_matmul_packed,
// launch_combine) over the emulated CUDA runtime of simt_runtime.h, so the plan (plan_t8, t8p_plan, the K splits),
// the choice of instantiation (persistent, deep, activations at use, scale mode, per-K combine) and the arguments
// are theirs; the launch log names what ran, and each case says what it expects to run. The launchers' choices
// depend on the device: the emulated H200 (132 SMs) sees small shapes as small, the emulated two-SM device sees
// them as the H200 sees the real ones (the persistent kernel with several units a CTA, activations read at use).
// The weights are random checkpoint-layout MXFP4 bytes packed by the repository's packer (pack_experts_mxfp4,
// pack_mxfp4_matrix); the twins read the checkpoint bytes.
//
// Grids run one after another on the emulator: the programmatic-dependent-launch waits have nothing to wait for,
// a grid sees every counter and value the grids before it wrote, and w2's per-slot readiness waits find their
// slots ready (a count never reached would show up as simt::Deadlock). What PDL overlap does to them is for
// tests/gpu (GpuMoe.T8ReadinessUnderPdlMatchesSerial). Outputs and the workspace start NaN-poisoned (0xFF, −1 as a
// counter): what a kernel does not write, or a counter the first kernel does not zero, shows up.
// The split and readiness counters are not reset by the GEMMs (the first kernel of the next call zeroes them), so
// after a run each holds its arrivals: the checks below ask exactly the split count of every (job, tile) that ran
// and the w1|w3 tiles of every valid slot, zero elsewhere in what the first kernel zeroed, and the poison beyond.
// Length (~1,100 lines): one file for the whole expert pipeline, whose cases share the experts, the routing builders,
// the run-and-log helper and the counter checks; its sections follow the pipeline (batch 1, grouped, scales, combine).
#include <gtest/gtest.h>

#include "simt.h"  // first: defines the CUDA surface the kernel headers below are written against
#include "simt_runtime.h"
//
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "../test_rng.h"
#include "core/dtype.h"
#include "emu_moe.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/moe_ops.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_layout.h"

namespace kestrel {
namespace {

using cuda::MoeTokenTile;
using testutil::Rng;
namespace md = cuda::moe_detail;
namespace ml = cuda::moe_layout;

constexpr float kBeta = 4.0f, kLinearBeta = 25.0f;  // SiTU's betas, as tests/gpu
constexpr double kBf16Ulp = 1.0 / 128;

// Host memory the kernels may take as device memory: 256-byte aligned (the workspace must be), `fill` in every byte.
struct Mem {
  std::unique_ptr<uint8_t, decltype(&std::free)> p{nullptr, &std::free};
  size_t bytes = 0;
  Mem() = default;
  explicit Mem(size_t n, int fill = 0xFF)
      : p(static_cast<uint8_t*>(std::aligned_alloc(256, (std::max<size_t>(n, 1) + 255) / 256 * 256)), &std::free),
        bytes(n) {
    std::memset(p.get(), fill, (std::max<size_t>(n, 1) + 255) / 256 * 256);
  }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(p.get());
  }
};
template <typename T>
Mem upload(const std::vector<T>& v) {
  Mem m(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(m.p.get(), v.data(), v.size() * sizeof(T));
  return m;
}
template <typename T>
std::vector<T> download(const Mem& m, size_t n) {
  std::vector<T> v(n);
  std::memcpy(v.data(), m.p.get(), n * sizeof(T));
  return v;
}

std::vector<uint16_t> rand_bf16(size_t n, Rng& rng, float lo, float hi) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(rng.uniform(lo, hi));
  return v;
}
std::vector<uint8_t> rand_u8(size_t n, Rng& rng, unsigned lo, unsigned hi) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = uint8_t(lo + rng.next() % (hi - lo + 1));
  return v;
}
std::vector<float> to_f32(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}

// got against ref element-wise: |Δ| ≤ atol + rtol·|ref| and the relative L2 error ≤ l2 over the finite ones; NaN
// exactly where ref has NaN (special scale codes), every other value finite (an unwritten, poisoned one fails).
void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, double atol,
                  double rtol, double l2, const std::vector<float>* bound = nullptr, double btol = 0) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double num = 0, den = 0;
  size_t bad = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    if (std::isnan(ref[i])) {
      ok = std::isnan(got[i]);
    } else {
      const double d = double(got[i]) - double(ref[i]);
      ok = std::isfinite(got[i]) &&
           std::fabs(d) <= atol + rtol * std::fabs(double(ref[i])) + (bound ? btol * double((*bound)[i]) : 0.0);
      if (std::isfinite(got[i])) num += d * d, den += double(ref[i]) * double(ref[i]);
    }
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " out of tolerance, first at " << first
                     << " (got " << (first < got.size() ? got[first] : 0.0f) << ", want "
                     << (first < got.size() ? ref[first] : 0.0f) << ")";
  EXPECT_LE(den > 0 ? std::sqrt(num / den) : std::sqrt(num), l2) << what << ": relative L2 error";
}
// ũ (or its norm) against the twin's: tests/gpu's check_moe, the same roundings (g, u, a, y, ũ) with FP32 sums in
// another order, a BF16 ulp here and there: atol 4e-3·max|ref|, rtol 2 ulps, relative L2 5e-3.
void expect_twin(const std::string& what, const std::vector<uint16_t>& got, const std::vector<uint16_t>& ref) {
  double scale = 0;
  for (uint16_t v : ref)
    if (std::isfinite(bf16_to_f32(v))) scale = std::max(scale, double(std::fabs(bf16_to_f32(v))));
  expect_close(what + " vs the CPU twin", to_f32(got), to_f32(ref), 4e-3 * scale, 2 * kBf16Ulp, 5e-3);
}
void expect_bits(const std::string& what, const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t diff = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && diff++ == 0) first = i;
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << got.size() << " values differ, first at " << first;
}

// ---- experts --------------------------------------------------------------------------------------------------
// X experts in the checkpoint layout (for the twins) and packed by cuda::pack_experts_mxfp4 into emulator memory.
struct Experts {
  int64_t X = 0, Lt = 0, I = 0;
  std::vector<uint8_t> w1p, w1s, w3p, w3s, w2p, w2s;
  std::vector<cpu::ExpertPtrs> twin;  // X + 1: the last one null, the twin's stand-in for an id outside [0, X)
  std::vector<Mem> bufs;
  cuda::MoeExpertWeights w{};
  int64_t s13() const { return I * Lt / 32; }  // scale bytes of one matrix of one expert (w1, w3 and w2 alike)
};
// e8m0 codes in [s_lo, s_hi]; `edit` may change the checkpoint bytes before the packing.
template <typename Edit>
std::unique_ptr<Experts> make_experts(int64_t X, int64_t Lt, int64_t I, Rng& rng, unsigned s_lo, unsigned s_hi,
                                      Edit&& edit) {
  auto ex = std::make_unique<Experts>();
  Experts& E = *ex;
  E.X = X, E.Lt = Lt, E.I = I;
  const size_t p13 = size_t(I * Lt / 2), s13 = size_t(I * Lt / 32);
  E.w1p = rand_u8(X * p13, rng, 0, 255), E.w3p = rand_u8(X * p13, rng, 0, 255), E.w2p = rand_u8(X * p13, rng, 0, 255);
  E.w1s = rand_u8(X * s13, rng, s_lo, s_hi), E.w3s = rand_u8(X * s13, rng, s_lo, s_hi);
  E.w2s = rand_u8(X * s13, rng, s_lo, s_hi);
  edit(E);
  std::vector<cuda::MoeExpertHost> host;
  for (int64_t e = 0; e < X; ++e) {
    const size_t a = size_t(e) * p13, b = size_t(e) * s13;
    E.twin.push_back({{&E.w1p[a], &E.w1s[b]}, {&E.w3p[a], &E.w3s[b]}, {&E.w2p[a], &E.w2s[b]}});
    host.push_back({&E.w1p[a], &E.w1s[b], &E.w3p[a], &E.w3s[b], &E.w2p[a], &E.w2s[b]});
  }
  E.twin.push_back({});  // w1.packed null: "another rank's expert", which the twin skips
  E.w = cuda::pack_experts_mxfp4(host.data(), X, Lt, I, [&E](size_t n) {
    E.bufs.emplace_back(n);
    return static_cast<void*>(E.bufs.back().p.get());
  });
  return ex;
}
std::unique_ptr<Experts> make_experts(int64_t X, int64_t Lt, int64_t I, Rng& rng, unsigned s_lo = 118,
                                      unsigned s_hi = 122) {
  return make_experts(X, Lt, I, rng, s_lo, s_hi, [](Experts&) {});
}

// ---- routing --------------------------------------------------------------------------------------------------
// ids for the kernels; twin_ids the same with every id outside [0, X) replaced by X (the twin's null expert: adds
// nothing whatever its weight, which stays as drawn, so a kernel that does not skip such a slot shows).
struct Routing {
  int64_t T = 0, K = 0;
  std::vector<int32_t> ids, twin_ids;
  std::vector<float> wts;
};
// K distinct experts a token from `pool`; `common` ≥ 0 is in every token's top-k (tokens sharing an expert).
Routing route(int64_t T, int64_t K, const std::vector<int32_t>& pool, Rng& rng, int32_t common = -1) {
  Routing r{T, K, {}, {}, {}};
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> p = pool;
    for (size_t i = p.size(); i > 1; --i) std::swap(p[i - 1], p[rng.next() % i]);
    p.resize(size_t(K));
    if (common >= 0 && std::find(p.begin(), p.end(), common) == p.end()) p[rng.next() % size_t(K)] = common;
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      r.ids.push_back(p[size_t(k)]);
      r.wts.push_back(rng.uniform(0.1f, 1.0f));
      sum += r.wts.back();
    }
    for (int64_t k = 0; k < K; ++k) r.wts[size_t(t * K + k)] /= sum;
  }
  r.twin_ids = r.ids;
  return r;
}
std::vector<int32_t> iota(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}
// Slot i gets `id` (outside [0, X): expert parallelism's −1, or an id past X) for the kernels.
void set_outside(Routing& r, size_t i, int32_t id, int64_t X) {
  r.ids[i] = id;
  r.twin_ids[i] = int32_t(X);
}

std::vector<uint16_t> twin(const Experts& E, const std::vector<uint16_t>& z, const Routing& r) {
  std::vector<uint16_t> ref(size_t(r.T * E.Lt));
  cpu::moe_experts(z.data(), r.twin_ids.data(), r.wts.data(), E.twin.data(), r.T, E.X + 1, r.K, E.Lt, E.I, kBeta,
                   kLinearBeta, ref.data());
  return ref;
}

// ---- one run of moe_experts_mxfp4 -----------------------------------------------------------------------------
struct MoeRun {
  std::vector<uint16_t> ut, normed;  // normed: with a norm weight only
  std::vector<std::string> launched;
  Mem ws;
};
MoeRun run_moe(const Experts& E, const std::vector<uint16_t>& z, const Routing& r, cuda::MoeExpertsOptions o,
               const std::vector<uint16_t>* norm_w = nullptr, int64_t normed_ld = 0) {
  const int64_t T = r.T, Lt = E.Lt;
  MoeRun out;
  out.ws = Mem(cuda::moe_experts_workspace_bytes(T, E.X, r.K, Lt, E.I, o.tile));
  const Mem dz = upload(z), dids = upload(r.ids), dw = upload(r.wts);
  Mem dut(size_t(T * Lt) * 2), dnw, dn;
  const int64_t ldn = normed_ld ? normed_ld : Lt;
  if (norm_w) {
    dnw = upload(*norm_w), dn = Mem(size_t(T * ldn) * 2);
    o.norm_w = dnw.as<uint16_t>(), o.norm_eps = 1e-6f, o.normed = dn.as<uint16_t>(), o.normed_ld = normed_ld;
  }
  simt::g_launches.clear();
  cuda::moe_experts_mxfp4(dz.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), E.w, T, E.X, r.K, Lt, E.I, kBeta,
                          kLinearBeta, out.ws.p.get(), dut.as<uint16_t>(), nullptr, o);
  for (const auto& l : simt::g_launches) out.launched.push_back(l.kernel);
  out.ut = download<uint16_t>(dut, size_t(T * Lt));
  if (norm_w) out.normed = download<uint16_t>(dn, size_t(T * ldn));
  return out;
}
std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// The launcher's t8 plan for these options (the call moe_experts_mxfp4 makes).
md::T8Plan plan_of(const Experts& E, const Routing& r, const cuda::MoeExpertsOptions& o, bool grouped) {
  return md::plan_t8(grouped, E.w.special_scales, r.T * r.K, E.X, E.Lt, E.I, o.t8_ksplit, o.t8_persist, o.t8p_split,
                     o.t8p_ctas, o.t8p_kh, int64_t(md::kStreamPartialBytes / 4), 2 * int64_t(md::kMaxStreamWarps));
}

// The counters after a t8 run (see the header): w1|w3's split tiles at [0, c13), w2's after them, each (job, tile) of
// a job that ran holding its split count; with `ready` the per-slot readiness after those, holding I/16 for a valid
// slot; zero elsewhere up to what the first kernel zeroed, the workspace's poison beyond.
void expect_counters(const std::string& what, const Experts& E, const Routing& r, const md::T8Plan& t8, bool grouped,
                     bool ready, const Mem& ws) {
  const int64_t n = r.T * r.K;
  const auto w = cuda::emu_moe::carve(ws.p.get(), n, E.X, E.Lt, E.I);
  const int64_t jobs = grouped ? *w.n_jobs : n, bound = grouped ? ml::job_bound(n, E.X, 8) : n;
  auto valid = [&](int64_t j) { return grouped ? j < jobs : unsigned(r.ids[size_t(j)]) < unsigned(E.X); };
  std::vector<int32_t> want;
  auto tiles = [&](int ks, int64_t rows) {
    if (ks <= 1) return;
    for (int64_t j = 0; j < bound; ++j)
      for (int64_t t = 0; t < rows / ml::kTileRows; ++t) want.push_back(valid(j) ? ks : 0);
  };
  tiles(t8.ks13, E.I);
  ASSERT_EQ(int64_t(want.size()), t8.c13) << what;
  tiles(t8.ks2, E.Lt);
  ASSERT_EQ(int64_t(want.size()), t8.n_zero) << what;
  if (ready)
    for (int64_t j = 0; j < n; ++j) want.push_back(valid(j) ? int32_t(E.I / ml::kTileRows) : 0);
  want.resize(want.size() + 64, -1);  // past what was zeroed: untouched
  const std::vector<int32_t> got(w.counters, w.counters + want.size());
  EXPECT_EQ(got, want) << what << ": split / readiness counters";
}

// The grouping kernel's work list (moe_experts.cu group_kernel): the valid slots in ascending expert order, each
// expert's slots cut into jobs of at most ct in that order, with their count.
void expect_work_list(const std::string& what, const Experts& E, const Routing& r, int ct, const Mem& ws) {
  const int64_t n = r.T * r.K;
  const auto w = cuda::emu_moe::carve(ws.p.get(), n, E.X, E.Lt, E.I);
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(E.X));
  for (int64_t i = 0; i < n; ++i)
    if (unsigned(r.ids[size_t(i)]) < unsigned(E.X)) slots[size_t(r.ids[size_t(i)])].push_back(int32_t(i));
  int64_t pos = 0, job = 0;
  for (int64_t e = 0; e < E.X; ++e) {
    const auto& s = slots[size_t(e)];
    std::vector<int32_t> got(w.order + pos, w.order + pos + s.size());  // an expert's slots in any order (atomics)
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, s) << what << ": the slots of expert " << e << " in the order";
    for (size_t c = 0; c < s.size(); c += size_t(ct), ++job) {
      const int32_t* jb = w.jobs + 3 * job;
      EXPECT_TRUE(jb[0] == e && jb[1] == pos + int64_t(c) && jb[2] == int32_t(std::min(s.size() - c, size_t(ct))))
          << what << ": job " << job << " = (" << jb[0] << ", " << jb[1] << ", " << jb[2] << ")";
    }
    pos += int64_t(s.size());
  }
  EXPECT_EQ(*w.n_jobs, job) << what << ": jobs";
}

// The RMSNorm of the fused combine + norm, against cpu::rmsnorm_bf16 on the twin's ũ (tests/gpu's tolerance) and on
// the run's own ũ (one rounding of a different Σx² apart: ≤ 2 ulps), and the padding of wider rows untouched.
void expect_norm(const std::string& what, const MoeRun& run, const std::vector<uint16_t>& ref_ut,
                 const std::vector<uint16_t>& nw, int64_t T, int64_t Lt, int64_t ldn) {
  std::vector<uint16_t> got(size_t(T * Lt));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(run.normed.begin() + t * ldn, Lt, got.begin() + t * Lt);
    for (int64_t j = Lt; j < ldn; ++j)
      ASSERT_EQ(run.normed[size_t(t * ldn + j)], 0xFFFF) << what << ": padding of normed row " << t << " written";
  }
  std::vector<uint16_t> ref(got.size()), own(got.size());
  cpu::rmsnorm_bf16(ref_ut.data(), nw.data(), ref.data(), T, Lt, 1e-6f);
  cpu::rmsnorm_bf16(run.ut.data(), nw.data(), own.data(), T, Lt, 1e-6f);
  expect_twin(what + " normed", got, ref);
  expect_close(what + " normed vs cpu::rmsnorm_bf16 of its own ũ", to_f32(got), to_f32(own), 1e-6, 2 * kBf16Ulp, 1e-2);
}

struct DeviceScope {  // runs a block on an emulated device (simt_runtime.h)
  int old;
  explicit DeviceScope(int d) : old(simt::g_device) { simt::g_device = d; }
  ~DeviceScope() { simt::g_device = old; }
};
constexpr int kH200 = 0, kTwoSms = 1;

cuda::MoeExpertsOptions t8_options() {
  cuda::MoeExpertsOptions o;
  o.tile = MoeTokenTile::t8;
  return o;
}

std::string device_name(int d) { return simt::g_devices[size_t(d)].name; }

// ---- batch 1 ----------------------------------------------------------------------------------------------------
// The decode step at one token as the engine runs it (automatic: t8, ungrouped, the latent norm fused into the
// combine), on the two-SM device where the launcher takes the persistent w1|w3 with K halves (8 CTAs of 8 units),
// and w2 on the fixed grid split in 2 waiting per slot; then the other ways of splitting the same work, each
// against the twin and bit-identical to the way that sums the same partials in the same order (same_as).
// X = 16 experts, top-8, Lt = 512, I = 256: w1|w3's 8 chunks a tile allow K halves of 4 chunks (one pipeline group:
// the peeled one) and whole tiles of 8 (a group in the loop, then the peeled one); w2's 4 chunks split 2 and 3 ways.
struct Batch1Case {
  const char* name;
  int device;
  cuda::MoeExpertsOptions o;
  std::vector<std::string> launched;
  const char* same_as;  // an earlier case with the same K splits, or nullptr
};
cuda::MoeExpertsOptions b1(int persist, int ksplit, int p_split, int p_kh) {
  cuda::MoeExpertsOptions o;
  o.t8_persist = persist, o.t8_ksplit = ksplit, o.t8p_split = p_split, o.t8p_kh = p_kh;
  return o;
}
const std::vector<Batch1Case>& batch1_cases() {
  static const std::string K8 = "combine+norm K=8", fixed13 = "t8 jit w1|w3 ungrouped folded h*2^100",
                           fixed2 = "t8 jit w2 ungrouped raw";
  static const std::vector<Batch1Case> cases = {
      {"automatic", kTwoSms, {}, {"prep", "t8p w1|w3 folded h*2^100", fixed2, K8}, nullptr},
      {"fixed grid, split 2", kTwoSms, b1(0, 2, 0, 0), {"prep", fixed13, fixed2, K8}, "automatic"},
      {"persistent, split 2 forced",
       kTwoSms,
       b1(1, 2, 2, 0),
       {"prep", "t8p w1|w3 folded h*2^100", fixed2, K8},
       "automatic"},
      {"fixed grid, automatic split", kTwoSms, b1(0, 0, 0, 0), {"prep", fixed13, fixed2, K8}, nullptr},
      {"both persistent, whole tiles",
       kTwoSms,
       b1(3, 0, 0, 1),
       {"prep", "t8p w1|w3 folded h*2^100", "t8p w2 raw", K8},
       "fixed grid, automatic split"},
      {"w2 persistent", kTwoSms, b1(2, 0, 0, 1), {"prep", fixed13, "t8p w2 raw", K8}, "fixed grid, automatic split"},
      {"fixed grid, split 3", kTwoSms, b1(0, 3, 0, 0), {"prep", fixed13, fixed2, K8}, nullptr},
      {"automatic on the H200",
       kH200,
       {},
       {"prep", "t8 staged w1|w3 ungrouped folded h*2^100", "t8 staged w2 ungrouped raw", K8},
       "fixed grid, automatic split"},
  };
  return cases;
}
void batch1(const Experts& E, const Routing& r, const std::vector<uint16_t>& z, const std::string& routing_name,
            const std::vector<std::string>& only = {}) {
  const int64_t T = 1, Lt = E.Lt;
  const std::vector<uint16_t> ref = twin(E, z, r);
  Rng rng(7);
  const auto nw = rand_bf16(size_t(Lt), rng, 0.5f, 1.5f);
  std::map<std::string, std::vector<uint16_t>> uts;
  for (const Batch1Case& c : batch1_cases()) {
    if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
    DeviceScope dev(c.device);
    const std::string what = routing_name + ", " + c.name + " (" + device_name(c.device) + ")";
    const MoeRun run = run_moe(E, z, r, c.o, &nw);
    EXPECT_EQ(run.launched, c.launched) << what << ": ran " << joined(run.launched);
    expect_twin(what, run.ut, ref);
    expect_norm(what, run, ref, nw, T, Lt, Lt);
    if (c.same_as) {
      ASSERT_TRUE(uts.count(c.same_as)) << c.same_as << " must run before " << c.name;
      expect_bits(what + " vs " + c.same_as, run.ut, uts[c.same_as]);
    }
    expect_counters(what, E, r, plan_of(E, r, c.o, false), false, true, run.ws);
    uts[c.name] = run.ut;
  }
}

TEST(EmuMoeDecode, Batch1EveryWayOfSplitting) {
  Rng rng(101);
  const auto E = make_experts(16, 512, 256, rng);
  const auto z = rand_bf16(512, rng, -1.0f, 1.0f);
  batch1(*E, route(1, 8, iota(16), rng), z, "T=1 top-8");
}

// Expert parallelism: slots with ids outside [0, X) (−1, X, 2^30) are skipped by every kernel — the persistent
// kernel compacts them away, the fixed grid's CTAs for them exit, the combine adds nothing for them (their y rows are
// never written: NaN-poisoned, and their weights are not 0).
Routing outside_rank(Rng& rng) {
  Routing r = route(1, 8, iota(16), rng);
  set_outside(r, 0, -1, 16), set_outside(r, 3, 16, 16), set_outside(r, 7, 1 << 30, 16);
  return r;
}
TEST(EmuMoeDecode, Batch1SkipsIdsOutsideTheRank) {
  Rng rng(102);
  const auto E = make_experts(16, 512, 256, rng);
  const auto z = rand_bf16(512, rng, -1.0f, 1.0f);
  batch1(*E, outside_rank(rng), z, "T=1 top-8, 3 ids outside");
}
TEST(EmuMoeSmoke, Batch1) {
  Rng rng(102);
  const auto E = make_experts(16, 512, 256, rng);
  const auto z = rand_bf16(512, rng, -1.0f, 1.0f);
  batch1(*E, outside_rank(rng), z, "T=1 top-8, 3 ids outside",
         {"automatic", "fixed grid, split 2", "fixed grid, automatic split", "both persistent, whole tiles"});
}

// The prep kernel zeroes the counters at every call: a second run on the same workspace (counters left at their
// arrival counts) gives the same bits.
TEST(EmuMoeDecode, SecondRunOnTheSameWorkspace) {
  Rng rng(103);
  const auto E = make_experts(16, 512, 256, rng);
  const auto z = rand_bf16(512, rng, -1.0f, 1.0f);
  const Routing r = route(1, 8, iota(16), rng);
  DeviceScope dev(kTwoSms);
  cuda::MoeExpertsOptions o;
  MoeRun first = run_moe(*E, z, r, o);
  Mem dz = upload(z), dids = upload(r.ids), dw = upload(r.wts), dut(size_t(E->Lt) * 2);
  cuda::moe_experts_mxfp4(dz.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), E->w, 1, E->X, r.K, E->Lt, E->I, kBeta,
                          kLinearBeta, first.ws.p.get(), dut.as<uint16_t>(), nullptr, o);
  expect_bits("second run", download<uint16_t>(dut, size_t(E->Lt)), first.ut);
}

// The deep w1|w3 pipeline (8 stages, activations at use) takes unsplit tiles of at least 32 chunks (Lt ≥ 2048):
// at one token on the H200, whose splits would fill no wave, and at four tokens on two SMs, whose 8 CTAs fill it.
TEST(EmuMoeSmoke, DeepPipeline) {
  Rng rng(104);
  const auto E = make_experts(8, 2048, 64, rng);
  for (const auto& [T, device] : {std::pair<int64_t, int>{1, kH200}, {4, kTwoSms}}) {
    DeviceScope dev(device);
    const auto z = rand_bf16(size_t(T * 2048), rng, -1.0f, 1.0f);
    const Routing r = route(T, 2, iota(8), rng, 5);
    cuda::MoeExpertsOptions o = t8_options();
    o.t8_persist = 0;
    const bool grouped = T > 1;
    const std::string g = grouped ? " grouped " : " ungrouped ";
    const MoeRun run = run_moe(*E, z, r, o);
    EXPECT_EQ(run.launched,
              (std::vector<std::string>{grouped ? "group" : "prep", "t8 deep w1|w3" + g + "folded h*2^100",
                                        (grouped ? "t8 jit w2" : "t8 staged w2") + g + "raw", "combine K=2"}))
        << joined(run.launched);
    expect_twin("deep T=" + std::to_string(T), run.ut, twin(*E, z, r));
  }
}

// ---- the three scale modes, FP32 scales, special codes ------------------------------------------------------------
// t8_scales 0 (FP32 per block in both GEMMs), 1 (folded into w1|w3's decode), 2 (folded, and w2's raw decode of
// h·2^100): with codes 100..128 and z in [−2, 2] (tests/gpu's GpuMoe.T8RawDecodeMatchesFp32Scales) every FP32
// partial of the raw w2 is 2^-26 times the FP32-scale one, so 2 and 1 give the same bits; each against the twin.
struct ScaleShape {
  int64_t T;
  int device, persist, ksplit;
};
void scale_modes(const std::vector<ScaleShape>& shapes, uint64_t seed) {
  Rng rng(seed);
  const auto E = make_experts(16, 512, 256, rng, 100, 128);
  for (const ScaleShape s : shapes) {
    DeviceScope dev(s.device);
    const auto z = rand_bf16(size_t(s.T * E->Lt), rng, -2.0f, 2.0f);
    const Routing r = route(s.T, 4, iota(16), rng, 2);
    const auto ref = twin(*E, z, r);
    const std::string shape = "T=" + std::to_string(s.T) + " persist " + std::to_string(s.persist) + " split " +
                              std::to_string(s.ksplit) + " (" + device_name(s.device) + ")";
    std::vector<uint16_t> folded;
    for (int scales : {1, 0, 2}) {
      cuda::MoeExpertsOptions o = t8_options();
      o.t8_scales = scales, o.t8_persist = s.persist, o.t8_ksplit = s.ksplit;
      const MoeRun run = run_moe(*E, z, r, o);
      const std::string what = shape + " t8_scales " + std::to_string(scales);
      const char* w13 = scales == 0 ? "f32-scales" : scales == 1 ? "folded" : "folded h*2^100";
      const char* w2 = scales == 2 ? "raw" : "f32-scales";
      ASSERT_EQ(run.launched.size(), 4u) << joined(run.launched);
      EXPECT_TRUE(run.launched[1].find("w1|w3") != std::string::npos &&
                  run.launched[1].ends_with(std::string(" ") + w13))
          << what << ": " << joined(run.launched);
      EXPECT_TRUE(run.launched[2].find("w2") != std::string::npos && run.launched[2].ends_with(std::string(" ") + w2))
          << what << ": " << joined(run.launched);
      expect_twin(what, run.ut, ref);
      if (scales == 1) folded = run.ut;
      if (scales == 2) expect_bits(what + " vs t8_scales 1", run.ut, folded);
    }
  }
}
TEST(EmuMoeScales, RawDecodeMatchesFoldedAndFp32) {
  scale_modes({{1, kTwoSms, -1, 0}, {1, kTwoSms, 0, 3}, {5, kH200, -1, 0}, {5, kH200, -1, 2}}, 111);
}
TEST(EmuMoeSmoke, ScaleModes) { scale_modes({{1, kTwoSms, -1, 0}}, 111); }

// Codes outside [1, 128] (MoeExpertWeights::fp32_scales): no fold, both GEMMs FP32 scales whatever t8_scales asks —
// the persistent kernels at one token too (w2 as well with whole tiles), t8 and t32 grouped.
TEST(EmuMoeSmoke, Fp32ScaleWeights) {
  Rng rng(112);
  const auto E = make_experts(8, 512, 256, rng, 110, 130);
  ASSERT_TRUE(E->w.fp32_scales && !E->w.special_scales);
  DeviceScope dev(kTwoSms);
  struct Case {
    int64_t T;
    MoeTokenTile tile;
    int persist, p_kh;
    std::vector<std::string> launched;
  };
  const std::vector<Case> cases = {
      {1,
       MoeTokenTile::automatic,
       -1,
       0,
       {"prep", "t8p w1|w3 f32-scales", "t8 jit w2 ungrouped f32-scales", "combine K=3"}},
      {1, MoeTokenTile::automatic, 3, 1, {"prep", "t8p w1|w3 f32-scales", "t8p w2 f32-scales", "combine K=3"}},
      {4,
       MoeTokenTile::automatic,
       -1,
       0,
       {"group", "t8 jit w1|w3 grouped f32-scales", "t8 jit w2 grouped f32-scales", "combine K=3"}},
      {4,
       MoeTokenTile::t32,
       -1,
       0,
       {"group", "t32 w1|w3 grouped f32-scales", "t32 w2 grouped f32-scales", "combine K=3"}},
  };
  for (const Case& c : cases) {
    const auto z = rand_bf16(size_t(c.T * E->Lt), rng, -1.0f, 1.0f);
    const Routing r = route(c.T, 3, iota(8), rng, 1);
    cuda::MoeExpertsOptions o;
    o.tile = c.tile, o.t8_persist = c.persist, o.t8p_kh = c.p_kh;
    const MoeRun run = run_moe(*E, z, r, o);
    EXPECT_EQ(run.launched, c.launched) << joined(run.launched);
    expect_twin("fp32 scales T=" + std::to_string(c.T) + " " + c.launched[1], run.ut, twin(*E, z, r));
  }
}

// Special codes (MoeExpertWeights::special_scales): e8m0 0 (2^-127) in w1 / w3 blocks and 255 (NaN) in one w2 block
// of expert 2 — the exact-scale kernels, never persistent; ũ NaN exactly where the twin's is (row 37 of every token,
// all routed to expert 2), within tolerance elsewhere.
TEST(EmuMoeSmoke, SpecialCodes) {
  Rng rng(113);
  const auto E = make_experts(8, 256, 128, rng, 118, 122, [](Experts& e) {
    for (size_t i = 0; i < e.w1s.size(); i += 7) e.w1s[i] = 0;
    for (size_t i = 3; i < e.w3s.size(); i += 11) e.w3s[i] = 0;
    e.w2s[size_t(2 * e.s13() + 37 * (e.I / 32) + 1)] = 255;  // expert 2, w2 row 37, block 1
  });
  ASSERT_TRUE(E->w.special_scales);
  // T = 1 on two SMs: w1|w3's 4 CTAs (2 slots × 2 row groups) are fewer than the 8 resident, so its activations are
  // staged with the weights, w2's 8 are not; T = 3 on the H200: both staged.
  for (const auto& [T, device] : {std::pair<int64_t, int>{1, kTwoSms}, {3, kH200}}) {
    DeviceScope dev(device);
    const auto z = rand_bf16(size_t(T * E->Lt), rng, -1.0f, 1.0f);
    const Routing r = route(T, 2, iota(8), rng, 2);
    const std::string g = T > 1 ? "grouped " : "ungrouped ";
    const auto ref = twin(*E, z, r);
    EXPECT_TRUE(std::isnan(bf16_to_f32(ref[37]))) << "the twin's NaN row";
    const MoeRun run = run_moe(*E, z, r, cuda::MoeExpertsOptions{});
    EXPECT_EQ(run.launched, (std::vector<std::string>{
                                T > 1 ? "group" : "prep", "t8 staged w1|w3 " + g + "special-scales",
                                (T > 1 ? "t8 staged w2 " : "t8 jit w2 ") + g + "special-scales", "combine K=2"}))
        << joined(run.launched);
    expect_twin("special codes T=" + std::to_string(T), run.ut, ref);
    if (T > 1) {  // and t32's exact-scale kernels
      cuda::MoeExpertsOptions o;
      o.tile = MoeTokenTile::t32;
      const MoeRun t32 = run_moe(*E, z, r, o);
      EXPECT_EQ(t32.launched, (std::vector<std::string>{"group", "t32 w1|w3 grouped special-scales",
                                                        "t32 w2 grouped special-scales", "combine K=2"}))
          << joined(t32.launched);
      expect_twin("special codes T=" + std::to_string(T) + " t32", t32.ut, ref);
    }
  }
}

// ---- grouped ----------------------------------------------------------------------------------------------------
// A few tokens (T = 2..12), grouped by expert: tokens sharing experts (jobs of several tokens, up to a full n-tile
// of 8 and an expert with 12: a job of 8 and one of 4), experts with no token, ids outside [0, X); the work list
// checked against the ids; t8 unsplit, split 2 and 3, t32 (jobs of up to 32), and ungrouped at T > 1 (one job a slot,
// which the persistent kernel may take: 64 slots at most).
struct GroupedCase {
  int64_t T;
  int32_t common;  // an expert in every token's top-k, or −1
  int outside;     // slots given ids outside [0, X)
};
struct GroupedVariant {
  const char* name;
  MoeTokenTile tile;
  int grouped, ksplit, device;
};
void grouped(const std::vector<GroupedCase>& cases, const std::vector<GroupedVariant>& variants, uint64_t seed) {
  Rng rng(seed);
  const int64_t X = 8, K = 4, Lt = 256, I = 128;
  const auto E = make_experts(X, Lt, I, rng);
  const std::vector<int32_t> pool = {0, 1, 2, 3, 4, 6};  // experts 5 and 7: no token
  for (const GroupedCase c : cases) {
    const auto z = rand_bf16(size_t(c.T * Lt), rng, -1.0f, 1.0f);
    Routing r = route(c.T, K, pool, rng, c.common);
    for (int b = 0; b < c.outside; ++b) set_outside(r, size_t(5 * b + 1), b % 2 ? int32_t(X) : -1, X);
    const auto ref = twin(*E, z, r);
    for (const GroupedVariant& v : variants) {
      DeviceScope dev(v.device);
      cuda::MoeExpertsOptions o;
      o.tile = v.tile, o.grouped = v.grouped, o.t8_ksplit = v.ksplit;
      const std::string what = "T=" + std::to_string(c.T) + " " + v.name + " (" + device_name(v.device) + ")";
      const MoeRun run = run_moe(*E, z, r, o);
      const bool grp = v.grouped != 0;
      ASSERT_EQ(run.launched.size(), 4u) << what << ": " << joined(run.launched);
      EXPECT_EQ(run.launched[0], grp ? "group" : "prep") << what;
      const std::string family = v.tile == MoeTokenTile::t32 ? "t32 " : "t8";  // t8 ungrouped may take t8p
      EXPECT_TRUE(run.launched[1].starts_with(family) && run.launched[1].find("w1|w3") != std::string::npos)
          << what << ": " << joined(run.launched);
      EXPECT_TRUE(run.launched[2].starts_with(family) &&
                  run.launched[2].find(grp ? "grouped" : "ungrouped") != std::string::npos)
          << what << ": " << joined(run.launched);
      expect_twin(what, run.ut, ref);
      if (grp) expect_work_list(what, *E, r, v.tile == MoeTokenTile::t32 ? 32 : 8, run.ws);
      if (v.tile == MoeTokenTile::t8) expect_counters(what, *E, r, plan_of(*E, r, o, grp), grp, !grp, run.ws);
    }
  }
}
TEST(EmuMoeGrouped, FewTokens) {
  std::vector<GroupedVariant> variants;
  for (int device : {kH200, kTwoSms}) {
    variants.push_back({"t8", MoeTokenTile::t8, -1, 0, device});
    variants.push_back({"t8 split 2", MoeTokenTile::t8, -1, 2, device});
    variants.push_back({"t8 split 3", MoeTokenTile::t8, -1, 3, device});
    variants.push_back({"t8 ungrouped", MoeTokenTile::t8, 0, 0, device});
  }
  variants.push_back({"t32", MoeTokenTile::t32, -1, 0, kH200});
  grouped({{2, 3, 0}, {5, -1, 2}, {8, 0, 0}, {12, 4, 3}}, variants, 121);
}
TEST(EmuMoeSmoke, Grouped) {
  grouped({{5, -1, 2}, {12, 4, 3}},
          {{"t8", MoeTokenTile::t8, -1, 0, kTwoSms},
           {"t8 split 3", MoeTokenTile::t8, -1, 3, kH200},
           {"t32", MoeTokenTile::t32, -1, 0, kH200},
           {"t8 ungrouped", MoeTokenTile::t8, 0, 0, kH200}},
          122);
}

// ---- combine ------------------------------------------------------------------------------------------------------
// The combine and the combine + norm through the pipeline for K = 1, 2, 8 (per-K kernels) and 12 (batches of 8),
// one and three tokens: ũ against the twin, the fused launch's ũ bit-identical to the plain combine's, its norm
// against cpu::rmsnorm_bf16, written into the left part of wider rows (normed_ld). K = 12 over 8 local experts:
// more slots than experts, the rest outside the rank.
void combine_through_pipeline(const std::vector<int64_t>& Ks, const std::vector<int64_t>& Ts, uint64_t seed) {
  Rng rng(seed);
  const int64_t Lt = 128, I = 64;
  for (int64_t K : Ks) {
    const int64_t X = K == 12 ? 8 : 16;
    const auto E = make_experts(X, Lt, I, rng);
    for (int64_t T : Ts) {
      const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
      Routing r;
      if (K <= X) {
        r = route(T, K, iota(X), rng);
        if (K > 1) set_outside(r, 1, -1, X);
      } else {  // each token: the 8 local experts and 4 slots of other ranks
        r = route(T, K, iota(K), rng);
        for (size_t i = 0; i < r.ids.size(); ++i)
          if (r.ids[i] >= X) set_outside(r, i, -1, X);
      }
      const auto ref = twin(*E, z, r);
      const auto nw = rand_bf16(size_t(Lt), rng, 0.5f, 1.5f);
      const std::string what = "K=" + std::to_string(K) + " T=" + std::to_string(T);
      const std::string kt = K > 8 ? " K>8" : " K=" + std::to_string(K);
      const MoeRun plain = run_moe(*E, z, r, cuda::MoeExpertsOptions{});
      EXPECT_EQ(plain.launched.back(), "combine" + kt) << what;
      expect_twin(what, plain.ut, ref);
      const MoeRun fused = run_moe(*E, z, r, cuda::MoeExpertsOptions{}, &nw, Lt + 64);
      EXPECT_EQ(fused.launched.back(), "combine+norm" + kt) << what;
      expect_bits(what + " ũ with the norm fused", fused.ut, plain.ut);
      expect_norm(what, fused, ref, nw, T, Lt, Lt + 64);
    }
  }
}
TEST(EmuMoeCombine, PlainAndNormedForEveryK) { combine_through_pipeline({1, 2, 8, 12}, {1, 3}, 131); }
TEST(EmuMoeSmoke, CombineThroughThePipeline) { combine_through_pipeline({2, 12}, {3}, 131); }

// launch_combine alone on given slot rows y, where the twin's combine rule is the whole reference — ũ_t = bf16(Σ_k
// w_k·y_k) in FP32, k in order, no FMA (cpu::moe_experts_f32's loop) — so ũ must match it bit for bit; slots outside
// [0, X) have NaN rows and nonzero weights (skipped, not multiplied by 0). Rows longer than the norm kernel holds in
// registers (Lt > 4096: its looping form) and shorter ones, K within and past the per-K kernels.
TEST(EmuMoeSmoke, LaunchCombineIsTheTwinsSum) {
  Rng rng(132);
  for (const int64_t Lt : {136, 4160}) {
    for (const int64_t K : {3, 9}) {
      const int64_t T = 2, X = 6;
      std::vector<uint16_t> y = rand_bf16(size_t(T * K * Lt), rng, -2.0f, 2.0f);
      std::vector<int32_t> ids(size_t(T * K));
      std::vector<float> wts(size_t(T * K));
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = i % 4 == 1 ? (i % 8 == 1 ? -1 : int32_t(X)) : int32_t(rng.next() % X);
        wts[i] = rng.uniform(0.05f, 0.5f);
        if (unsigned(ids[i]) >= unsigned(X)) std::fill_n(y.begin() + int64_t(i) * Lt, Lt, uint16_t(0xFFFF));
      }
      std::vector<uint16_t> ref(size_t(T * Lt));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < Lt; ++j) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k)
            if (unsigned(ids[size_t(t * K + k)]) < unsigned(X))
              acc += wts[size_t(t * K + k)] * bf16_to_f32(y[size_t((t * K + k) * Lt + j)]);
          ref[size_t(t * Lt + j)] = f32_to_bf16(acc);
        }
      const auto nw = rand_bf16(size_t(Lt), rng, 0.5f, 1.5f);
      const Mem dy = upload(y), dids = upload(ids), dw = upload(wts), dnw = upload(nw);
      Mem dut(size_t(T * Lt) * 2), dut2(size_t(T * Lt) * 2), dn(size_t(T * Lt) * 2);
      const std::string what = "Lt=" + std::to_string(Lt) + " K=" + std::to_string(K);
      simt::g_launches.clear();
      md::launch_combine(dy.as<uint16_t>(), dw.as<float>(), dids.as<int32_t>(), T, K, X, Lt, dut.as<uint16_t>(),
                         nullptr, 0.0f, nullptr, Lt, true, nullptr);
      md::launch_combine(dy.as<uint16_t>(), dw.as<float>(), dids.as<int32_t>(), T, K, X, Lt, dut2.as<uint16_t>(),
                         dnw.as<uint16_t>(), 1e-6f, dn.as<uint16_t>(), Lt, true, nullptr);
      ASSERT_EQ(simt::g_launches.size(), 2u);
      EXPECT_EQ(simt::g_launches[0].kernel, K > 8 ? "combine K>8" : "combine K=" + std::to_string(K)) << what;
      expect_bits(what + " combine vs the twin's sum", download<uint16_t>(dut, size_t(T * Lt)), ref);
      expect_bits(what + " combine+norm's ũ vs the twin's sum", download<uint16_t>(dut2, size_t(T * Lt)), ref);
      std::vector<uint16_t> nref(ref.size());
      cpu::rmsnorm_bf16(ref.data(), nw.data(), nref.data(), T, Lt, 1e-6f);
      expect_close(what + " normed vs cpu::rmsnorm_bf16", to_f32(download<uint16_t>(dn, size_t(T * Lt))), to_f32(nref),
                   1e-6, 2 * kBf16Ulp, 1e-2);
    }
  }
}

// ---- combine + norm over a cluster -------------------------------------------------------------------------------
// moe_combine.cu's cluster kernel (MoeExpertsOptions::combine_cluster = 1) through launch_combine on nano's and the
// mini's latent widths (Lt 128: one CTA of one warp; 3584: 7 CTAs of 64 vectors), K within and past the per-K kernels
// (16: batches of 8), one token, three, and the bound of 64; ids outside [0, X) (−1, X) over NaN rows with nonzero
// weights. ũ must be the twin's sum bit for bit (so also the one-CTA kernel's); normed, written into the left part of
// rows wider than Lt, within 2 BF16 steps of the one-CTA kernel's (bit-identical at C = 1) and of cpu::rmsnorm_bf16
// on ũ — the tolerance moe_combine.cu's header derives. Without a norm the option changes nothing (the plain combine
// runs); past 64 tokens the one-CTA kernel runs.

// BF16 steps between two values: their patterns' distance on the ordered line (−0 and +0 the same point).
int bf16_steps(uint16_t a, uint16_t b) {
  auto ord = [](uint16_t v) { return v & 0x8000u ? -int(v & 0x7FFFu) : int(v); };
  return std::abs(ord(a) - ord(b));
}
// got within max_steps of want everywhere (both finite); *differ counts the elements that are not identical.
void expect_steps(const std::string& what, const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                  int max_steps, size_t* differ = nullptr) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, diff = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const bool finite = std::isfinite(bf16_to_f32(got[i])) && std::isfinite(bf16_to_f32(want[i]));
    diff += got[i] != want[i];
    if ((!finite || bf16_steps(got[i], want[i]) > max_steps) && bad++ == 0) first = i;
  }
  if (differ) *differ = diff;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " more than " << max_steps
                     << " BF16 steps apart (or not finite), first at " << first << " (got "
                     << (first < got.size() ? bf16_to_f32(got[first]) : 0.0f) << ", want "
                     << (first < got.size() ? bf16_to_f32(want[first]) : 0.0f) << ")";
}

constexpr int kClusterSteps = 2;  // moe_combine.cu: normed within 2 BF16 steps of the one-CTA kernel's

struct CombineInputs {
  int64_t T, K, X, Lt;
  std::vector<uint16_t> y, nw;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  std::vector<uint16_t> ref;  // the twin's ũ: Σ_k w_k·y_k in FP32, k in order, no FMA, one BF16 rounding
};
CombineInputs combine_inputs(int64_t T, int64_t K, int64_t Lt, Rng& rng) {
  CombineInputs in{T, K, 16, Lt, rand_bf16(size_t(T * K * Lt), rng, -2.0f, 2.0f), rand_bf16(size_t(Lt), rng, 0.5f, 1.5f),
                   std::vector<int32_t>(size_t(T * K)), std::vector<float>(size_t(T * K)), {}};
  for (size_t i = 0; i < in.ids.size(); ++i) {
    // Every fifth slot outside the rank (−1 and X in turn): with K = 1 whole rows of ũ are 0 (Σx² = 0, r = 1/√eps).
    in.ids[i] = i % 5 == 3 ? (i % 10 == 3 ? -1 : int32_t(in.X)) : int32_t(rng.next() % uint64_t(in.X));
    in.wts[i] = rng.uniform(0.05f, 0.5f);
    if (unsigned(in.ids[i]) >= unsigned(in.X)) std::fill_n(in.y.begin() + int64_t(i) * Lt, Lt, uint16_t(0xFFFF));
  }
  in.ref.resize(size_t(T * Lt));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < Lt; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        if (unsigned(in.ids[size_t(t * K + k)]) < unsigned(in.X))
          acc += in.wts[size_t(t * K + k)] * bf16_to_f32(in.y[size_t((t * K + k) * Lt + j)]);
      in.ref[size_t(t * Lt + j)] = f32_to_bf16(acc);
    }
  return in;
}
struct CombineOut {
  std::vector<uint16_t> ut, normed;  // normed: the Lt left columns of each row
  simt::Launched launch;
};
// One launch_combine: with `norm` the fused RMSNorm into rows of ldn = Lt + 64 (the padding must stay poisoned).
CombineOut run_combine(const std::string& what, const CombineInputs& in, bool norm, int cluster) {
  const int64_t T = in.T, Lt = in.Lt, ldn = Lt + 64;
  const Mem dy = upload(in.y), dids = upload(in.ids), dw = upload(in.wts), dnw = upload(in.nw);
  Mem dut(size_t(T * Lt) * 2), dn(size_t(T * ldn) * 2);
  simt::g_launches.clear();
  md::launch_combine(dy.as<uint16_t>(), dw.as<float>(), dids.as<int32_t>(), T, in.K, in.X, Lt, dut.as<uint16_t>(),
                     norm ? dnw.as<uint16_t>() : nullptr, 1e-6f, norm ? dn.as<uint16_t>() : nullptr, ldn, true, nullptr,
                     cluster);
  CombineOut out;
  EXPECT_EQ(simt::g_launches.size(), 1u) << what;
  if (simt::g_launches.size() == 1) out.launch = simt::g_launches[0];
  out.ut = download<uint16_t>(dut, size_t(T * Lt));
  if (norm) {
    const auto rows = download<uint16_t>(dn, size_t(T * ldn));
    for (int64_t t = 0; t < T; ++t) {
      out.normed.insert(out.normed.end(), rows.begin() + t * ldn, rows.begin() + t * ldn + Lt);
      for (int64_t j = Lt; j < ldn; ++j)
        if (rows[size_t(t * ldn + j)] != 0xFFFF) {
          ADD_FAILURE() << what << ": padding of normed row " << t << " written";
          break;
        }
    }
  }
  return out;
}
// The cluster size the launcher picks for a row of Lt (moe_combine.cu: 64 vectors a CTA at least, 8 CTAs at most).
unsigned expected_cluster(int64_t Lt) { return unsigned(std::clamp<int64_t>((Lt / 8 + 63) / 64, 1, 8)); }

void combine_cluster_cases(const std::vector<int64_t>& Lts, const std::vector<int64_t>& Ks,
                           const std::vector<int64_t>& Ts, uint64_t seed) {
  Rng rng(seed);
  for (const int64_t Lt : Lts)
    for (const int64_t K : Ks)
      for (const int64_t T : Ts) {
        const CombineInputs in = combine_inputs(T, K, Lt, rng);
        const std::string what = "Lt=" + std::to_string(Lt) + " K=" + std::to_string(K) + " T=" + std::to_string(T);
        const std::string kt = K > 8 ? " K>8" : " K=" + std::to_string(K);
        const CombineOut one = run_combine(what + " one CTA", in, true, 0);
        const CombineOut cl = run_combine(what + " cluster", in, true, 1);
        const CombineOut plain = run_combine(what + " no norm", in, false, 1);
        EXPECT_EQ(one.launch.kernel, "combine+norm" + kt) << what;
        EXPECT_EQ(plain.launch.kernel, "combine" + kt) << what << ": the option without a norm";
        const bool applies = T <= md::kCombineClusterMaxT;
        const unsigned C = expected_cluster(Lt);
        if (applies) {
          EXPECT_EQ(cl.launch.kernel, "combine+norm cluster" + kt) << what;
          EXPECT_TRUE(cl.launch.grid.x == C && cl.launch.grid.y == unsigned(T) && cl.launch.cluster.x == (C > 1 ? C : 1))
              << what << ": grid " << cl.launch.grid.x << "×" << cl.launch.grid.y << ", cluster " << cl.launch.cluster.x;
          EXPECT_TRUE(cl.launch.pdl) << what;
        } else {
          EXPECT_EQ(cl.launch.kernel, "combine+norm" + kt) << what << ": past the cluster kernel's bound";
        }
        expect_bits(what + " cluster ũ vs the twin's sum", cl.ut, in.ref);
        expect_bits(what + " one-CTA ũ vs the twin's sum", one.ut, in.ref);
        expect_bits(what + " plain ũ vs the twin's sum", plain.ut, in.ref);
        std::vector<uint16_t> cpu_n(in.ref.size());
        cpu::rmsnorm_bf16(in.ref.data(), in.nw.data(), cpu_n.data(), T, Lt, 1e-6f);
        size_t differ = 0;
        expect_steps(what + " cluster normed vs the one-CTA kernel's", cl.normed, one.normed, kClusterSteps, &differ);
        if (C == 1 || !applies) {
          EXPECT_EQ(differ, 0u) << what << ": the same Σx² order, the same bits";
        }
        expect_steps(what + " cluster normed vs cpu::rmsnorm_bf16", cl.normed, cpu_n, kClusterSteps);
        expect_steps(what + " one-CTA normed vs cpu::rmsnorm_bf16", one.normed, cpu_n, kClusterSteps);
      }
}
TEST(EmuMoeCombine, ClusterNormEveryShape) {
  combine_cluster_cases({128, 3584}, {1, 2, 4, 8, 16}, {1, 3, 64}, 161);
  combine_cluster_cases({128, 1024, 4160, 16384}, {3}, {2, 65}, 162);  // C = 2, 8 (65 vectors a CTA), 8 × 256; T > 64
}
TEST(EmuMoeSmoke, ClusterNorm) { combine_cluster_cases({128, 3584}, {2, 16}, {3}, 163); }

// Through moe_experts_mxfp4 (MoeExpertsOptions::combine_cluster): nano's shape and a mini-like Lt = 3584 with a small I,
// one and three tokens, an id outside the rank; ũ bit-identical to the one-CTA run's (and within the twin's
// tolerance), normed within 2 steps of it (nano: identical), the option's 0 and −1 (the environment, unset in tests:
// off) the one-CTA kernel.
void cluster_through_pipeline(const std::vector<int64_t>& Lts, const std::vector<int64_t>& Ts, uint64_t seed) {
  Rng rng(seed);
  for (const int64_t Lt : Lts) {
    const int64_t X = 8, K = 2, I = 64;
    const auto E = make_experts(X, Lt, I, rng);
    for (const int64_t T : Ts) {
      const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
      Routing r = route(T, K, iota(X), rng);
      set_outside(r, size_t(T * K - 1), -1, X);
      const auto ref = twin(*E, z, r);
      const auto nw = rand_bf16(size_t(Lt), rng, 0.5f, 1.5f);
      const std::string what = "pipeline Lt=" + std::to_string(Lt) + " T=" + std::to_string(T);
      cuda::MoeExpertsOptions o;
      o.combine_cluster = 1;
      const MoeRun cl = run_moe(*E, z, r, o, &nw, Lt + 64);
      o.combine_cluster = 0;
      const MoeRun one = run_moe(*E, z, r, o, &nw, Lt + 64);
      o.combine_cluster = -1;
      const MoeRun env = run_moe(*E, z, r, o, &nw, Lt + 64);
      EXPECT_EQ(cl.launched.back(), "combine+norm cluster K=2") << what << ": " << joined(cl.launched);
      EXPECT_EQ(one.launched.back(), "combine+norm K=2") << what;
      EXPECT_EQ(env.launched.back(), "combine+norm K=2") << what << ": the default is off";
      expect_twin(what, cl.ut, ref);
      expect_bits(what + " ũ, cluster vs one CTA", cl.ut, one.ut);
      expect_norm(what + " cluster", cl, ref, nw, T, Lt, Lt + 64);
      std::vector<uint16_t> a, b;
      for (int64_t t = 0; t < T; ++t) {
        a.insert(a.end(), cl.normed.begin() + t * (Lt + 64), cl.normed.begin() + t * (Lt + 64) + Lt);
        b.insert(b.end(), one.normed.begin() + t * (Lt + 64), one.normed.begin() + t * (Lt + 64) + Lt);
      }
      size_t differ = 0;
      expect_steps(what + " normed, cluster vs one CTA", a, b, kClusterSteps, &differ);
      if (expected_cluster(Lt) == 1) {
        EXPECT_EQ(differ, 0u) << what << ": the same Σx² order, the same bits";
      }
    }
  }
}
TEST(EmuMoeCombine, ClusterThroughThePipeline) { cluster_through_pipeline({128, 3584}, {1, 3}, 164); }
TEST(EmuMoeSmoke, ClusterThroughThePipeline) { cluster_through_pipeline({128}, {3}, 165); }

// The cluster kernel's bits do not depend on the order its threads and CTAs run in: a missing cluster barrier (a
// partial read before it is written, a CTA leaving while another still reads its shared memory — the emulator
// throws on that) or CTA barrier shows up under one of the schedules; `ctas` runs each CTA as far as it can first.
void cluster_schedules(const std::vector<int64_t>& Ts, const std::vector<simt::Schedule>& schedules, uint64_t seed) {
  Rng rng(seed);
  for (const int64_t Lt : {128, 3584})
    for (const int64_t T : Ts) {
      const CombineInputs in = combine_inputs(T, 2, Lt, rng);
      const std::string what = "Lt=" + std::to_string(Lt) + " T=" + std::to_string(T);
      const CombineOut first = run_combine(what, in, true, 1);
      for (const simt::Schedule sch : schedules) {
        simt::g_schedule = sch;
        const CombineOut run = run_combine(what, in, true, 1);
        simt::g_schedule = simt::Schedule::threads;
        const std::string w = what + " schedule " + std::to_string(int(sch));
        EXPECT_EQ(run.launch.kernel, "combine+norm cluster K=2") << w;
        expect_bits(w + " ũ", run.ut, first.ut);
        expect_bits(w + " normed", run.normed, first.normed);
      }
    }
}
TEST(EmuMoeCombine, ClusterScheduleOrderDoesNotMatter) {
  cluster_schedules({1, 3},
                    {simt::Schedule::threads_reverse, simt::Schedule::warps, simt::Schedule::warps_reverse,
                     simt::Schedule::ctas},
                    166);
}
TEST(EmuMoeSmoke, ClusterScheduleOrder) {
  cluster_schedules({1}, {simt::Schedule::warps_reverse, simt::Schedule::ctas}, 167);
}

// ---- one matrix: every code and scale
// --------------------------------------------------------------------------------- mxfp4_matmul_packed (the grouping
// kernel and the t8 / t32 GEMM for one matrix W [R, C]) against cpu::mxfp4_gemm: random bytes (all 16 E2M1 codes at
// every position), e8m0 scales over the whole range 0..255 in bands (tests/gpu's GpuMoe.MatmulEveryCodeAndScale), x
// scaled to keep every output finite and normal; the FP32-scale and exact-scale kernels. Per element |Δ| ≤ 2^-7·|ref|
// (one BF16 rounding of sums in another order) + 2^-16·Σ|w·x| (FP32 order), NaN exactly where the twin has NaN.
struct Mx {
  int64_t R = 0, C = 0;
  std::vector<uint8_t> packed, scale;
};
void check_matmul(const std::string& what, const Mx& m, const std::vector<float>& x_in, int64_t T, MoeTokenTile tile) {
  const bool special = cuda::mxfp4_special_scales(m.scale.data(), m.scale.size());
  const bool fp32 = cuda::mxfp4_fp32_scales(m.scale.data(), m.scale.size());
  std::vector<uint8_t> kp(m.packed.size()), ks(m.scale.size());
  cuda::pack_mxfp4_matrix(m.packed.data(), m.scale.data(), m.R, m.C, kp.data(), ks.data());
  std::vector<uint16_t> xb(x_in.size());
  std::vector<float> x(x_in.size());  // the BF16 values both sides see
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_f32(xb[i] = f32_to_bf16(x_in[i]));
  const Mem dx = upload(xb), dp = upload(kp), ds = upload(ks);
  Mem dy(size_t(T * m.R) * 2), dws(cuda::mxfp4_matmul_workspace_bytes(T));
  simt::g_launches.clear();
  cuda::mxfp4_matmul_packed(dx.as<uint16_t>(), dp.as<uint8_t>(), ds.as<uint8_t>(), special, fp32, T, m.R, m.C,
                            dws.p.get(), dy.as<uint16_t>(), nullptr, tile);
  ASSERT_EQ(simt::g_launches.size(), 2u) << what;
  const std::string gemm = simt::g_launches[1].kernel;
  EXPECT_EQ(gemm.rfind(tile == MoeTokenTile::t32 ? "t32 w2 grouped " : "t8 ", 0), 0u) << what << ": " << gemm;
  EXPECT_TRUE(gemm.ends_with(special ? "special-scales" : "f32-scales")) << what << ": " << gemm;
  std::vector<float> ref(size_t(T * m.R)), bound(ref.size());
  cpu::mxfp4_gemm(m.packed.data(), m.scale.data(), x.data(), ref.data(), T, m.R, m.C);
  Mx a = m;  // Σ|w|·|x| by the same twin on |W| and |x|: the scale of rounding differences
  for (auto& b : a.packed) b &= 0x77;
  std::vector<float> ax(x.size());
  for (size_t i = 0; i < x.size(); ++i) ax[i] = std::fabs(x[i]);
  cpu::mxfp4_gemm(a.packed.data(), a.scale.data(), ax.data(), bound.data(), T, m.R, m.C);
  for (auto& v : ref) v = round_bf16(v);
  expect_close(what, to_f32(download<uint16_t>(dy, size_t(T * m.R))), ref, 0.0, kBf16Ulp, 1.0, &bound, 0x1p-16);
}
struct Range {
  unsigned e_lo, e_hi;
  int x_exp;  // |x| ≈ 2^x_exp keeps every output finite and normal
};
void every_code_and_scale(const std::vector<int64_t>& Cs, const std::vector<Range>& ranges,
                          const std::vector<int64_t>& Ts, uint64_t seed) {
  Rng rng(seed);
  for (const int64_t C : Cs) {
    const int64_t R = 64;
    for (const Range& e : ranges) {
      Mx m{R, C, rand_u8(size_t(R * C / 2), rng, 0, 255), rand_u8(size_t(R * C / 32), rng, e.e_lo, e.e_hi)};
      for (int64_t r = 0; r < R; ++r)
        for (int64_t b = 0; b < C / 32; ++b)
          if (m.scale[size_t(r * (C / 32) + b)] >= 253)  // |v|·2^(e−127) must stay finite for the twin
            for (int64_t j = 0; j < 16; ++j) m.packed[size_t(r * C / 2 + b * 16 + j)] &= 0xBB;
      for (const int64_t T : Ts) {
        std::vector<float> x(size_t(T * C));
        for (auto& v : x)
          v = std::ldexp(rng.uniform(1.0f, 2.0f), e.x_exp - int(rng.next() % 3)) * (rng.next() & 1 ? -1.0f : 1.0f);
        for (const MoeTokenTile tile : {MoeTokenTile::t8, MoeTokenTile::t32})
          check_matmul(std::to_string(R) + "x" + std::to_string(C) + " T=" + std::to_string(T) + " codes " +
                           std::to_string(e.e_lo) + ".." + std::to_string(e.e_hi) +
                           (tile == MoeTokenTile::t32 ? " t32" : " t8"),
                       m, x, T, tile);
      }
    }
  }
  // e8m0 255 (NaN) and 0 (2^-127) through the exact-scale kernels: rows 0..15 at 0 with token 0's x large (so they
  // give normal outputs), two NaN blocks.
  Mx m{64, 256, rand_u8(64 * 128, rng, 0, 255), rand_u8(64 * 8, rng, 120, 124)};
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t b = 0; b < 8; ++b) m.scale[size_t(r * 8 + b)] = 0;
  m.scale[size_t(20 * 8 + 3)] = 255;
  m.scale[size_t(63 * 8 + 7)] = 255;
  for (const int64_t T : {1, 9}) {
    std::vector<float> x(size_t(T * 256));
    for (auto& v : x) v = rng.uniform(-2.0f, 2.0f);
    for (int64_t k = 0; k < 256; ++k) x[size_t(k)] *= 0x1p100f;
    for (const MoeTokenTile tile : {MoeTokenTile::t8, MoeTokenTile::t32})
      check_matmul("64x256 T=" + std::to_string(T) + " scales 0/255" + (tile == MoeTokenTile::t32 ? " t32" : " t8"), m,
                   x, T, tile);
  }
}
TEST(EmuMoeMatmul, EveryCodeAndScale) {
  every_code_and_scale({128, 512},
                       {{118, 122, 0}, {1, 40, 60}, {41, 128, 0}, {0, 40, 60}, {41, 200, 0}, {201, 254, -80}},
                       {1, 9, 40}, 141);
}
TEST(EmuMoeSmoke, MatmulScaleBands) {
  every_code_and_scale({128}, {{1, 40, 60}, {0, 40, 60}, {41, 200, 0}}, {1, 9}, 142);
}

// ---- schedule order -------------------------------------------------------------------------------------------------
// Results must not depend on the order the emulator runs threads in: a missing barrier (the K halves' exchange in
// shared memory, the grouping kernel's scan, the norm's block sum) lets some schedule read shared memory not yet
// written or already overwritten.
void schedule_order(const std::vector<int64_t>& Ts, const std::vector<simt::Schedule>& schedules, uint64_t seed) {
  Rng rng(seed);
  const auto E = make_experts(16, 512, 256, rng);
  const auto nw = rand_bf16(512, rng, 0.5f, 1.5f);
  for (const int64_t T : Ts) {
    DeviceScope dev(T == 1 ? kTwoSms : kH200);
    const auto z = rand_bf16(size_t(T * 512), rng, -1.0f, 1.0f);
    const Routing r = route(T, 4, iota(16), rng, 3);
    cuda::MoeExpertsOptions o;
    if (T > 1) o.t8_ksplit = 2;
    const MoeRun first = run_moe(*E, z, r, o, &nw);
    for (const simt::Schedule sch : schedules) {
      simt::g_schedule = sch;
      const MoeRun run = run_moe(*E, z, r, o, &nw);
      simt::g_schedule = simt::Schedule::threads;
      const std::string what = "T=" + std::to_string(T) + " schedule " + std::to_string(int(sch));
      EXPECT_EQ(run.launched, first.launched) << what;
      expect_bits(what, run.ut, first.ut);
      expect_bits(what + " normed", run.normed, first.normed);
    }
  }
}
TEST(EmuMoeDecode, ScheduleOrderDoesNotMatter) {
  schedule_order(
      {1, 5},
      {simt::Schedule::threads_reverse, simt::Schedule::warps, simt::Schedule::warps_reverse, simt::Schedule::ctas},
      151);
}
TEST(EmuMoeSmoke, ScheduleOrder) { schedule_order({1}, {simt::Schedule::warps, simt::Schedule::warps_reverse}, 152); }

}  // namespace
}  // namespace kestrel
