// The KDA scan kernels (src/kernels/cuda/kda_chunked*.cu, kda.cu) run on the CPU emulation
// of simt.h and checked against the CPU twins, with the tolerances of tests/gpu/test_kda_gpu.cpp: every
// variant of kda_chunked's intra and seq launches, the FP16 pool's rounding, the two decode kernels. This
// catches index, fragment-layout and barrier mistakes before the GPU runs the same code (tests/gpu then adds
// the real tensor cores, timing and scale). The host launchers are not compiled here (they need CUDA); the
// launches below use the grids and shared-memory sizes the launchers use.
#include <gtest/gtest.h>

#include "simt.h"  // first: defines the CUDA surface the kernel sources below are written against

#include "kernels/cuda/kda.cu"
#include "kernels/cuda/kda_chunked.cu"
#include "kernels/cuda/kda_chunked_v1.cu"
#include "kernels/cuda/kda_chunked_intra2.cu"
#include "kernels/cuda/kda_chunked_seq2.cu"
//
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "../test_rng.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"

namespace kestrel {
namespace {

namespace kd = cuda::kda_detail;

using testutil::Rng;

enum class Gates { model, near_bound, near_zero };

// Packed inputs of B requests as the model feeds the scan (q, k L2-normalised through the CPU twin of
// steps 3–5, q scaled by Dk^−½), optionally with gates at the −5 bound or near 0; distinct slots in random
// order among B + 3.
struct Inputs {
  int64_t H = 0, Dk = 0, T = 0, B = 0, n_slots = 0;
  std::vector<int32_t> lens, cu, slots;
  std::vector<float> q, k, v, g, beta, pool0;
};
Inputs make_inputs(const std::vector<int32_t>& lens, int64_t H, int64_t Dk, Gates gates, Rng& rng) {
  Inputs in;
  in.H = H, in.Dk = Dk, in.lens = lens, in.B = int64_t(lens.size());
  in.cu.assign(size_t(in.B + 1), 0);
  for (int64_t b = 0; b < in.B; ++b) in.cu[size_t(b + 1)] = in.cu[size_t(b)] + lens[size_t(b)];
  in.T = in.cu.back();
  const int64_t HD = H * Dk, T = std::max<int64_t>(in.T, 1);
  auto rbf = [&](size_t n, float lo, float hi) {
    std::vector<uint16_t> x(n);
    for (auto& e : x) e = f32_to_bf16(rng.uniform(lo, hi));
    return x;
  };
  auto rf = [&](size_t n, float lo, float hi) {
    std::vector<float> x(n);
    for (auto& e : x) e = rng.uniform(lo, hi);
    return x;
  };
  const auto qb = rbf(size_t(T * HD), -1, 1), kb = rbf(size_t(T * HD), -1, 1);
  const auto zb = rbf(size_t(T * HD), -3, 3), bb = rbf(size_t(T * H), -3, 3);
  const auto dt_bias = rf(size_t(HD), -1, 1), a_log = rf(size_t(H), -1, 1.5f);
  in.q.resize(qb.size());
  in.k.resize(kb.size());
  for (size_t i = 0; i < qb.size(); ++i) in.q[i] = bf16_to_f32(qb[i]), in.k[i] = bf16_to_f32(kb[i]);
  in.g.resize(size_t(T * HD));
  in.beta.resize(size_t(T * H));
  cpu::kda_qk_norm_gates(in.q.data(), in.k.data(), zb.data(), dt_bias.data(), a_log.data(), bb.data(), -5.0f,
                         in.g.data(), in.beta.data(), T, H, Dk);
  if (gates == Gates::near_bound) in.g = rf(size_t(T * HD), -4.999f, -4.9f);
  if (gates == Gates::near_zero) in.g = rf(size_t(T * HD), -1e-3f, -1e-6f);
  in.v = rf(size_t(T * HD), -1, 1);
  in.n_slots = in.B + 3;
  in.pool0 = rf(size_t(in.n_slots * H * Dk * Dk), -0.1f, 0.1f);
  std::vector<int32_t> all(size_t(in.n_slots));
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = all.size(); i > 1; --i) std::swap(all[i - 1], all[rng.next() % i]);
  in.slots.assign(all.begin(), all.begin() + in.B);
  return in;
}

// The CPU oracle: o, and the pool updated in place.
std::vector<float> cpu_scan(const Inputs& in, std::vector<float>& pool) {
  const int64_t HD = in.H * in.Dk, DD = in.Dk * in.Dk;
  std::vector<float> o(size_t(std::max<int64_t>(in.T, 1) * HD), 0.0f);
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t h = 0; h < in.H; ++h) {
      const int64_t t0 = in.cu[size_t(b)];
      const cpu::KdaHeadIo io{in.q.data() + t0 * HD + h * in.Dk, in.k.data() + t0 * HD + h * in.Dk,
                              in.v.data() + t0 * HD + h * in.Dk, in.g.data() + t0 * HD + h * in.Dk,
                              in.beta.data() + t0 * in.H + h,   HD,
                              in.H,                             o.data() + t0 * HD + h * in.Dk};
      cpu::kda_scan_recurrent(io, in.lens[size_t(b)], in.Dk, pool.data() + (in.slots[size_t(b)] * in.H + h) * DD);
    }
  return o;
}

// |got − ref| ≤ atol + rtol·|ref| everywhere and ‖got − ref‖ ≤ l2·‖ref‖ (non-finite got fails).
void expect_close(const std::string& what, const float* got, const float* ref, size_t n, double atol, double rtol,
                  double l2) {
  double num = 0, den = 0, worst = 0;
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
    const double lim = atol + rtol * std::fabs(double(ref[i]));
    if (!std::isfinite(got[i]) || std::fabs(d) > lim) {
      if (first == n) first = i;
      ++bad;
    }
    if (std::isfinite(got[i])) worst = std::max(worst, std::fabs(d));
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " elements out of tolerance, first at " << first
                     << " (got " << (first < n ? got[first] : 0.0f) << ", want " << (first < n ? ref[first] : 0.0f)
                     << "), max |err| " << worst;
  EXPECT_LE(rel, l2) << what << ": relative L2 error " << rel;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

struct Aligned {  // NaN-poisoned (0xFF) bytes, 256-byte aligned
  std::unique_ptr<unsigned char, decltype(&std::free)> p{nullptr, &std::free};
  explicit Aligned(size_t n)
      : p(static_cast<unsigned char*>(std::aligned_alloc(256, (n + 255) / 256 * 256)), &std::free) {
    std::memset(p.get(), 0xFF, (n + 255) / 256 * 256);
  }
};

// kda_chunked's launches on the emulator, in two steps so that several seq variants run on one set of
// images: chunk table + an intra variant into a workspace (image format f32, or FP16 with f16), then a seq
// variant on those images (seq 1..4 as in kda.h; the launch grids and shared memory of the launchers).
struct Images {
  Aligned ws;
  int32_t *cs, *cseq;
  char* imgs;
  bool f16;
};
template <int K>
Images make_images(const Inputs& in, int intra, bool f16) {
  const int H = int(in.H), B = int(in.B), HD = int(in.H * K);
  const int64_t cap = kd::capacity_chunks(in.T, in.B);
  Images im{Aligned(kd::table_bytes(in.B, cap) + size_t(cap) * size_t(H) * kd::Img<K>::bytes), nullptr, nullptr,
            nullptr, f16};
  im.cs = reinterpret_cast<int32_t*>(im.ws.p.get());
  im.cseq = im.cs + B + 1;
  im.imgs = reinterpret_cast<char*>(im.ws.p.get()) + kd::table_bytes(in.B, cap);
  const int32_t* cu = in.cu.data();
  const float *q = in.q.data(), *k = in.k.data(), *v = in.v.data(), *g = in.g.data(), *beta = in.beta.data();
  int32_t *cs = im.cs, *cseq = im.cseq;
  char* imgs = im.imgs;
  simt::launch(dim3(1), dim3(1024), 0, [&] { kd::chunk_table_kernel(cu, B, int(cap), cs, cseq); });
  const dim3 grid{unsigned(cap), unsigned(H), 1u};
  if (intra == 1) {
    simt::launch(grid, dim3(512), kd::IntraSmem<K>::bytes,
                 [&] { kd::intra_kernel<K>(q, k, v, g, HD, beta, H, cu, cs, cseq, B, imgs, H); });
  } else if (f16) {
    simt::launch(grid, dim3(512), kd::Intra2Smem<K, true>::bytes,
                 [&] { kd::intra2_kernel<K, true>(q, k, v, g, HD, beta, H, cu, cs, cseq, B, imgs, H); });
  } else {
    simt::launch(grid, dim3(512), kd::Intra2Smem<K, false>::bytes,
                 [&] { kd::intra2_kernel<K, false>(q, k, v, g, HD, beta, H, cu, cs, cseq, B, imgs, H); });
  }
  return im;
}

template <int K, typename StateT, int VM, bool F16, bool MC>
void launch_seq2(const Inputs& in, const Images& im, StateT* p, float* out) {
  const int H = int(in.H), B = int(in.B), HD = int(in.H * K);
  const int32_t *cu = in.cu.data(), *slots = in.slots.data(), *cs = im.cs;
  const char* imgs = im.imgs;
  simt::launch(
      dim3(K / (16 * VM), unsigned(H), unsigned(B)), dim3(64 * VM), kd::Seq2Layout<K, VM, F16, MC>::smem,
      [&] { kd::seq2_kernel<K, StateT, VM, F16, MC>(cu, cs, slots, imgs, p, out, HD, H); },
      MC ? dim3(K / (16 * VM)) : dim3(1));
}

template <int K, typename StateT>
std::vector<float> run_seq(const Inputs& in, const Images& im, int seq, std::vector<StateT>& pool) {
  std::vector<float> o(size_t(std::max<int64_t>(in.T, 1) * in.H * K), std::nanf(""));
  StateT* p = pool.data();
  float* out = o.data();
  if (seq == 1) {
    const int H = int(in.H), B = int(in.B), HD = int(in.H * K);
    const int32_t *cu = in.cu.data(), *slots = in.slots.data(), *cs = im.cs;
    const char* imgs = im.imgs;
    simt::launch(dim3(K / 32, unsigned(H), unsigned(B)), dim3(64), 2 * kd::Img<K>::stage_bytes(32) + 16,
                 [&] { kd::seq_kernel<K, StateT>(cu, cs, slots, imgs, p, out, HD, H); });
  } else if (im.f16) {
    if (seq == 2) launch_seq2<K, StateT, 2, true, false>(in, im, p, out);
    if (seq == 3) launch_seq2<K, StateT, 1, true, false>(in, im, p, out);
    if (seq == 4) launch_seq2<K, StateT, 1, true, true>(in, im, p, out);
  } else {
    if (seq == 2) launch_seq2<K, StateT, 2, false, false>(in, im, p, out);
    if (seq == 3) launch_seq2<K, StateT, 1, false, false>(in, im, p, out);
    if (seq == 4) launch_seq2<K, StateT, 1, false, true>(in, im, p, out);
  }
  return o;
}

// Variant sets: (intra, FP16 images, seq variants run on those images).
struct VariantSet {
  int intra;
  bool f16;
  std::vector<int> seqs;
};
const std::vector<VariantSet> kAllVariants = {{1, false, {1, 2, 3, 4}}, {2, false, {1, 2, 3, 4}}, {2, true, {2, 3, 4}}};

template <int K>
void check_chunked_case(const std::vector<int32_t>& lens, int64_t H, Gates gates, uint64_t seed,
                        const std::vector<VariantSet>& sets = kAllVariants) {
  Rng rng(seed);
  const Inputs in = make_inputs(lens, H, K, gates, rng);
  std::vector<float> ref_pool = in.pool0;
  const auto ref_o = cpu_scan(in, ref_pool);
  const double so = max_abs(ref_o), ss = max_abs(ref_pool);
  const size_t no = size_t(in.T * H * K);
  for (const VariantSet& vs : sets) {
    const Images im = make_images<K>(in, vs.intra, vs.f16);
    for (const int seq : vs.seqs) {
      const std::string what = "Dk=" + std::to_string(K) + " H=" + std::to_string(H) + " T=" + std::to_string(in.T) +
                               " B=" + std::to_string(in.B) + " intra" + std::to_string(vs.intra) +
                               (vs.f16 ? " f16" : "") + " seq" + std::to_string(seq);
      std::vector<float> pool = in.pool0;
      const auto o = run_seq<K, float>(in, im, seq, pool);
      expect_close(what + " o", o.data(), ref_o.data(), no, 2e-2 * so, 2e-2, 6e-3);
      expect_close(what + " state", pool.data(), ref_pool.data(), pool.size(), 1e-2 * ss, 1e-2, 3e-3);
      // Slots no request with tokens uses come back bit for bit.
      std::vector<bool> touched(size_t(in.n_slots), false);
      for (int64_t b = 0; b < in.B; ++b) touched[size_t(in.slots[size_t(b)])] = in.lens[size_t(b)] > 0;
      const size_t per = size_t(H * K * K);
      for (int64_t sl = 0; sl < in.n_slots; ++sl) {
        if (touched[size_t(sl)]) continue;
        EXPECT_EQ(std::memcmp(pool.data() + sl * per, in.pool0.data() + sl * per, per * 4), 0)
            << what << ": untouched slot " << sl << " changed";
      }
    }
  }
}

const std::vector<int32_t> kMix = {1, 63, 0, 64, 65, 130};

TEST(EmuKdaChunked, Dk32AllVariants) {
  for (const auto& lens : std::vector<std::vector<int32_t>>{{1}, {63}, {64}, {65}, {200}, kMix})
    check_chunked_case<32>(lens, 2, Gates::model, 11 + lens.size() + size_t(lens[0]));
  check_chunked_case<32>(kMix, 2, Gates::near_bound, 12);
  check_chunked_case<32>(kMix, 2, Gates::near_zero, 13);
}

TEST(EmuKdaChunked, Dk64AllVariants) {
  check_chunked_case<64>({130}, 1, Gates::model, 21);
  check_chunked_case<64>(kMix, 1, Gates::near_bound, 22);
}

TEST(EmuKdaChunked, Dk128AllVariants) {
  check_chunked_case<128>({65}, 1, Gates::model, 31);
  check_chunked_case<128>({1, 0, 150}, 1, Gates::near_bound, 32);
  check_chunked_case<128>({129}, 1, Gates::near_zero, 33, {{2, false, {2, 3, 4}}, {2, true, {2, 3, 4}}});
}

// The FP16 pool: widened once, the same scan, rounded once (RNE): from an FP16-representable start the
// outputs equal the FP32 launch's bit for bit and the states its states rounded to FP16.
TEST(EmuKdaChunked, F16PoolRoundsTheF32Result) {
  Rng rng(41);
  const Inputs in = make_inputs(kMix, 2, 64, Gates::model, rng);
  std::vector<float> p32(in.pool0.size());
  std::vector<uint16_t> p16(in.pool0.size());
  for (size_t i = 0; i < p16.size(); ++i) p16[i] = f32_to_f16(in.pool0[i]), p32[i] = f16_to_f32(p16[i]);
  for (const bool f16_images : {false, true}) {
    const Images im = make_images<64>(in, 2, f16_images);
    for (const int seq : {2, 3, 4}) {
      std::vector<float> s32 = p32;
      std::vector<uint16_t> s16 = p16;
      const auto o32 = run_seq<64, float>(in, im, seq, s32);
      const auto o16 = run_seq<64, uint16_t>(in, im, seq, s16);
      EXPECT_EQ(std::memcmp(o32.data(), o16.data(), size_t(in.T * in.H * 64) * 4), 0) << "seq" << seq << " o";
      for (size_t i = 0; i < s16.size(); ++i)
        ASSERT_EQ(s16[i], f32_to_f16(s32[i])) << "seq" << seq << " state element " << i;
    }
  }
}

// Results must not depend on the order threads run in: a missing barrier lets some schedule read data not yet
// written (NaN-poisoned shared memory, a stale value) or already overwritten.
const simt::Schedule kSchedules[] = {simt::Schedule::threads_reverse, simt::Schedule::warps,
                                     simt::Schedule::warps_reverse, simt::Schedule::ctas};
TEST(EmuKdaChunked, ScheduleOrderDoesNotMatter) {
  Rng rng(51);
  const Inputs in = make_inputs({70, 1, 129}, 1, 128, Gates::model, rng);
  struct Case {
    int intra;
    bool f16;
    int seq;
  };
  for (const Case& c : {Case{2, false, 2}, Case{2, false, 3}, Case{1, false, 1}, Case{2, true, 2}, Case{2, false, 4},
                        Case{2, true, 4}}) {
    simt::g_schedule = simt::Schedule::threads;
    const Images im = make_images<128>(in, c.intra, c.f16);
    std::vector<float> pf = in.pool0;
    const auto of = run_seq<128, float>(in, im, c.seq, pf);
    for (const simt::Schedule sch : kSchedules) {
      simt::g_schedule = sch;
      const Images imr = make_images<128>(in, c.intra, c.f16);
      std::vector<float> pr = in.pool0;
      const auto orr = run_seq<128, float>(in, imr, c.seq, pr);
      simt::g_schedule = simt::Schedule::threads;
      const std::string what = "intra" + std::to_string(c.intra) + (c.f16 ? " f16" : "") + " seq" +
                               std::to_string(c.seq) + " schedule " + std::to_string(int(sch));
      EXPECT_EQ(std::memcmp(of.data(), orr.data(), of.size() * 4), 0) << what << " o";
      EXPECT_EQ(std::memcmp(pf.data(), pr.data(), pf.size() * 4), 0) << what << " state";
    }
  }
}

// Decode: the per-item kernel and the persistent prefetching kernel (with fewer blocks than items, so every
// block walks several items and prefetches across them) give identical bits, and match the CPU recurrence.
template <int DK, typename StateT>
void run_decode(const Inputs& in, bool stream, unsigned blocks, std::vector<StateT>& pool, std::vector<float>& o) {
  const int64_t H = in.H, HD = H * DK;
  const int32_t *cu = in.cu.data(), *slots = in.slots.data();
  const float *q = in.q.data(), *k = in.k.data(), *v = in.v.data(), *g = in.g.data(), *beta = in.beta.data();
  StateT* p = pool.data();
  float* out = o.data();
  if (stream) {
    const int64_t n_items = in.B * H * (DK / 32);
    simt::launch(dim3(blocks), dim3(128), size_t(2) * DK * 32 * sizeof(StateT), [&] {
      cuda::decode_stream_kernel<DK, StateT>(q, k, v, g, HD, beta, H, cu, slots, p, out, H, n_items);
    });
  } else {
    simt::launch(dim3(DK / 32, unsigned(H), unsigned(in.B)), dim3(128), 0,
                 [&] { cuda::decode_kernel<DK, StateT>(q, k, v, g, HD, beta, H, cu, slots, p, out, H); });
  }
}

template <int DK>
void check_decode(const std::vector<int32_t>& lens, int64_t H, uint64_t seed) {
  Rng rng(seed);
  const Inputs in = make_inputs(lens, H, DK, Gates::model, rng);
  std::vector<float> ref_pool = in.pool0;
  const auto ref_o = cpu_scan(in, ref_pool);
  const size_t no = size_t(std::max<int64_t>(in.T, 1) * H * DK);
  std::vector<float> pa = in.pool0, pb = in.pool0, oa(no, std::nanf("")), ob(no, std::nanf(""));
  run_decode<DK, float>(in, false, 0, pa, oa);
  simt::g_schedule = simt::Schedule::warps_reverse;  // the stream kernel under the most skewed schedule
  run_decode<DK, float>(in, true, 5, pb, ob);
  simt::g_schedule = simt::Schedule::threads;
  const std::string what = "decode Dk=" + std::to_string(DK) + " B=" + std::to_string(in.B);
  EXPECT_EQ(std::memcmp(oa.data(), ob.data(), size_t(in.T * H * DK) * 4), 0) << what << " o: stream != blocks";
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * 4), 0) << what << " state: stream != blocks";
  const double so = max_abs(ref_o), ss = max_abs(ref_pool);
  expect_close(what + " o", ob.data(), ref_o.data(), size_t(in.T * H * DK), 1e-5 * so, 1e-4, 2e-5);
  expect_close(what + " state", pb.data(), ref_pool.data(), pb.size(), 1e-5 * ss, 1e-4, 2e-5);
  // FP16 pool: the stream kernel (8-byte copies) equals the block kernel bit for bit.
  std::vector<uint16_t> ha(in.pool0.size()), hb;
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = f32_to_f16(in.pool0[i]);
  hb = ha;
  std::vector<float> oc(no, std::nanf("")), od(no, std::nanf(""));
  run_decode<DK, uint16_t>(in, false, 0, ha, oc);
  run_decode<DK, uint16_t>(in, true, 3, hb, od);
  EXPECT_EQ(std::memcmp(oc.data(), od.data(), size_t(in.T * H * DK) * 4), 0) << what << " f16 o";
  EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.size() * 2), 0) << what << " f16 state";
}

TEST(EmuKdaDecode, StreamKernelMatchesBlockKernel) {
  check_decode<32>(std::vector<int32_t>(9, 1), 2, 61);
  check_decode<64>({1, 3, 0, 1, 2}, 2, 62);
  check_decode<128>(std::vector<int32_t>(4, 1), 3, 63);
}

// The one emulator case CI runs (the others carry the ctest label `emu`, minutes each: tests/emu/CMakeLists.txt):
// every variant on a sequence of two chunks (one partial) next to an empty one and a one-token one, Dk 32, then
// both decode kernels on a small batch.
TEST(EmuKdaSmoke, Dk32EveryVariantAndDecode) {
  check_chunked_case<32>({70, 0, 1}, 1, Gates::model, 14);
  check_decode<32>(std::vector<int32_t>(3, 1), 1, 64);
}

}  // namespace
}  // namespace kestrel
