// KDA delta-rule scans on the GPU against their CPU twins (MODEL.md §3.3 step 6): the chunk-parallel
// prefill scan kda_chunked (tensor cores; every variant of its intra and seq kernels) against
// cpu::kda_scan_recurrent (the oracle) and cpu::kda_scan_chunked (its twin), and the decode-specialised
// kda_decode (both kernels) against kda_recurrent and the CPU oracle. See harness.h for the rules (random
// inputs, NaN-poisoned outputs, stated tolerances). tests/emu runs the same kernel sources on a CPU
// emulation of the thread hierarchy, without a GPU.
//
// Tolerances of kda_chunked (relative to the FP32 CPU scans). The recurrence runs TF32 products (11
// significant bits: ~2e-4 relative rounding per product term) and the output products BF16 (8 bits:
// ~2.3e-3 per term, the size of the one BF16 rounding o gets after the output norm anyway). Expected (a
// numpy emulation of the kernels with their operand rounding, Dk 32–128, up to 1000 tokens): rel-L2 of o
// 2.3–3.4e-3 (max error ≤ 4.4e-3·max|o|), of the final state 3–6e-4, not growing with length.
// Enforced: o rel-L2 ≤ 6e-3 and |err| ≤ 2e-2·max|o| + 2e-2·|ref|; state rel-L2 ≤ 3e-3 and
// |err| ≤ 1e-2·max|S| + 1e-2·|ref|. A layout or indexing slip gives O(1) errors, far above these.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <thread>

#include "harness.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda.h"

namespace kestrel::gputest {
namespace {

struct Shape {
  int64_t H, Dk;
  const char* what;
};
const Shape kShapes[] = {{4, 32, "nano"}, {4, 64, "Dk64"}, {12, 128, "mini"}};

enum class Gates { model, near_bound, near_zero };
const char* gates_name(Gates g) {
  return g == Gates::model ? "gates σ" : g == Gates::near_bound ? "gates ≈ −5" : "gates ≈ 0";
}

// Packed inputs of B requests: q, k L2-normalised (q also scaled by Dk^−½), v, g, β, as the model feeds
// the scan (through the CPU twin of steps 3–5 with random pre-norm values); `gates` then overrides g
// with values at the −5 bound or near 0; `ties` makes every token of a request share one k and one q.
struct ScanInputs {
  std::vector<int32_t> lens, cu, slots;
  std::vector<float> q, k, v, g, beta, pool0;
  int64_t T = 0, B = 0, n_slots = 0;
};
ScanInputs make_inputs(const std::vector<int32_t>& lens, const Shape& s, Gates gates, bool ties, Rng& rng) {
  ScanInputs in;
  in.lens = lens;
  in.B = int64_t(lens.size());
  in.cu.assign(size_t(in.B + 1), 0);
  for (int64_t b = 0; b < in.B; ++b) in.cu[size_t(b + 1)] = in.cu[size_t(b)] + lens[size_t(b)];
  in.T = in.cu.back();
  const int64_t HD = s.H * s.Dk, T = std::max<int64_t>(in.T, 1);
  auto qb = rand_bf16(size_t(T * HD), rng, -1.0f, 1.0f), kb = rand_bf16(size_t(T * HD), rng, -1.0f, 1.0f);
  const auto zb = rand_bf16(size_t(T * HD), rng, -3.0f, 3.0f), bb = rand_bf16(size_t(T * s.H), rng, -3.0f, 3.0f);
  const auto dt_bias = rand_f32(size_t(HD), rng, -1.0f, 1.0f), a_log = rand_f32(size_t(s.H), rng, -1.0f, 1.5f);
  if (ties) {
    for (int64_t b = 0; b < in.B; ++b)
      for (int64_t t = in.cu[size_t(b)] + 1; t < in.cu[size_t(b + 1)]; ++t) {
        std::copy_n(&qb[size_t(in.cu[size_t(b)] * HD)], HD, &qb[size_t(t * HD)]);
        std::copy_n(&kb[size_t(in.cu[size_t(b)] * HD)], HD, &kb[size_t(t * HD)]);
      }
  }
  in.q = to_f32(qb);
  in.k = to_f32(kb);
  in.g.resize(size_t(T * HD));
  in.beta.resize(size_t(T * s.H));
  cpu::kda_qk_norm_gates(in.q.data(), in.k.data(), zb.data(), dt_bias.data(), a_log.data(), bb.data(), -5.0f,
                         in.g.data(), in.beta.data(), T, s.H, s.Dk);
  if (gates == Gates::near_bound) in.g = rand_f32(size_t(T * HD), rng, -4.999f, -4.9f);
  if (gates == Gates::near_zero) in.g = rand_f32(size_t(T * HD), rng, -1e-3f, -1e-6f);
  in.v = rand_f32(size_t(T * HD), rng, -1.0f, 1.0f);
  in.n_slots = in.B + 3;
  in.pool0 = rand_f32(size_t(in.n_slots * s.H * s.Dk * s.Dk), rng, -0.1f, 0.1f);
  // Distinct slots in random order.
  std::vector<int32_t> all(size_t(in.n_slots));
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = all.size(); i > 1; --i) std::swap(all[i - 1], all[rng.next() % i]);
  in.slots.assign(all.begin(), all.begin() + in.B);
  return in;
}

// The CPU scan of every (request, head), in parallel over them (the CPU twins keep their scratch
// thread-local). Returns o and updates `pool` in place.
std::vector<float> cpu_scan(const ScanInputs& in, const Shape& s, bool chunked, std::vector<float>& pool) {
  const int64_t HD = s.H * s.Dk, DD = s.Dk * s.Dk;
  std::vector<float> o(size_t(std::max<int64_t>(in.T, 1) * HD), 0.0f);
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t j; (j = next++) < in.B * s.H;) {
      const int64_t b = j / s.H, h = j % s.H, t0 = in.cu[size_t(b)];
      const cpu::KdaHeadIo io{in.q.data() + t0 * HD + h * s.Dk,   in.k.data() + t0 * HD + h * s.Dk,
                              in.v.data() + t0 * HD + h * s.Dk,   in.g.data() + t0 * HD + h * s.Dk,
                              in.beta.data() + t0 * s.H + h,      HD,
                              s.H,                                o.data() + t0 * HD + h * s.Dk};
      float* S = pool.data() + (in.slots[size_t(b)] * s.H + h) * DD;
      if (chunked) {
        cpu::kda_scan_chunked(io, in.lens[size_t(b)], s.Dk, S);
      } else {
        cpu::kda_scan_recurrent(io, in.lens[size_t(b)], s.Dk, S);
      }
    }
  };
  std::vector<std::thread> th;
  const unsigned n = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  for (unsigned i = 0; i < n; ++i) th.emplace_back(work);
  for (auto& t : th) t.join();
  return o;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

struct Dev4 {  // the scan inputs on the device
  Dev<float> q, k, v, g, beta;
  Dev<int32_t> cu, slots;
};
Dev4 upload_inputs(const ScanInputs& in) {
  return {upload(in.q), upload(in.k), upload(in.v), upload(in.g), upload(in.beta), upload(in.cu), upload(in.slots)};
}

// kda_chunked with an explicit workspace, poisoned with NaN bytes so that a read of anything the
// intra-chunk launch did not write shows up in the outputs; by default the engine's variant, which the
// overloads without a variant run.
template <typename StateT>
void run_chunked(const Dev4& d, const ScanInputs& in, const Shape& s, StateT* pool, float* o, int64_t T_arg,
                 const cuda::KdaChunkedVariant& var = cuda::kda_chunked_default_variant()) {
  const size_t ws_bytes = cuda::kda_chunked_workspace_bytes(T_arg, in.B, s.H, s.Dk);
  auto ws = poisoned<uint8_t>(ws_bytes);
  cuda::kda_chunked(d.q.p(), d.k.p(), d.v.p(), d.g.p(), s.H * s.Dk, d.beta.p(), s.H, d.cu.p(), d.slots.p(), pool, o,
                    T_arg, in.B, s.H, s.Dk, ws.p(), nullptr, var);
  sync();
}

// Every (intra, seq) pair of kda_chunked's kernel variants (kda.h), the FP16 recurrence with the seq kernels
// that take it, and seq 0 (an alias of 2). KdaChunkedVariant{} is {1, 1}.
struct Variant {
  int intra, seq;
  bool f16 = false;
};
const Variant kVariants[] = {{1, 1}, {1, 2},       {1, 3},       {1, 4},       {2, 1},      {2, 2},
                             {2, 3}, {2, 4}, {2, 2, true}, {2, 3, true}, {2, 4, true}, {2, 0}};
cuda::KdaChunkedVariant as_variant(const Variant& v) {
  cuda::KdaChunkedVariant r;
  r.intra = v.intra;
  r.seq = v.seq;
  r.f16_recurrence = v.f16;
  return r;
}
std::string variant_name(const Variant& v) {
  return fmt::format("intra{} seq{}{}", v.intra, v.seq, v.f16 ? " f16" : "");
}

struct ChunkCase {
  std::vector<int32_t> lens;
  Gates gates;
  bool ties;
  const char* what;
};

TEST(GpuKda, ChunkedMatchesCpuScans) {
  need_gpu();
  Rng rng(41);
  const std::vector<int32_t> mix = {1, 63, 0, 64, 65, 200, 130, 17};
  const ChunkCase cases[] = {
      {{1}, Gates::model, false, "T=1"},           {{63}, Gates::model, false, "T=63"},
      {{64}, Gates::model, false, "T=64"},         {{65}, Gates::model, false, "T=65"},
      {{200}, Gates::model, false, "T=200"},       {{200}, Gates::model, true, "T=200 ties"},
      {{4100}, Gates::model, false, "T=4100"},     {{4100}, Gates::near_bound, false, "T=4100"},
      {{4100}, Gates::near_zero, false, "T=4100"}, {mix, Gates::model, false, "varlen"},
      {mix, Gates::near_bound, false, "varlen"},   {mix, Gates::near_zero, false, "varlen"},
  };
  for (const Shape& s : kShapes) {
    const int64_t HD = s.H * s.Dk;
    for (const ChunkCase& c : cases) {
      const ScanInputs in = make_inputs(c.lens, s, c.gates, c.ties, rng);
      const Dev4 d = upload_inputs(in);
      std::vector<float> ref_pool[2] = {in.pool0, in.pool0};
      const std::vector<float> ref_o[2] = {cpu_scan(in, s, false, ref_pool[0]), cpu_scan(in, s, true, ref_pool[1])};
      for (const Variant& var : kVariants) {
        auto dpool = upload(in.pool0);
        auto dout = poisoned<float>(size_t(std::max<int64_t>(in.T, 1) * HD));
        run_chunked(d, in, s, dpool.p(), dout.p(), in.T, as_variant(var));
        const auto got_o = dout.get(), got_pool = dpool.get();
        const std::string base = fmt::format("{} {} B={} T={} H={} Dk={} {} {}", s.what, c.what, in.B, in.T, s.H, s.Dk,
                                             gates_name(c.gates), variant_name(var));
        for (const bool chunked : {false, true}) {
          const std::vector<float>& pool = ref_pool[chunked];
          const std::vector<float>& o = ref_o[chunked];
          const std::string shape = base + (chunked ? " vs CPU chunked" : " vs CPU recurrent");
          const double so = max_abs(o), ss = max_abs(pool);
          check("kda_chunked (o)", shape, got_o.data(), o.data(), size_t(in.T * HD), {2e-2 * so, 2e-2, 6e-3});
          check("kda_chunked (state pool)", shape, got_pool.data(), pool.data(), pool.size(), {1e-2 * ss, 1e-2, 3e-3});
        }
        // Slots no request uses, and the slot of a request of length 0, come back bit for bit.
        const int64_t DD = s.Dk * s.Dk;
        std::vector<bool> touched(size_t(in.n_slots), false);
        for (int64_t b = 0; b < in.B; ++b) touched[size_t(in.slots[size_t(b)])] = in.lens[size_t(b)] > 0;
        for (int64_t sl = 0; sl < in.n_slots; ++sl) {
          if (touched[size_t(sl)]) continue;
          const size_t off = size_t(sl * s.H * DD), n = size_t(s.H * DD);
          check_exact("kda_chunked (untouched slot)", base + fmt::format(" slot {}", sl), got_pool.data() + off,
                      in.pool0.data() + off, n * 4);
        }
        // FP16 pool: widened once, the same FP32 scan, rounded once (RNE). From an FP16-representable start
        // it must give the FP32 launch's outputs and its final states rounded to FP16, bit for bit.
        std::vector<float> p32(in.pool0.size());
        std::vector<uint16_t> p16(in.pool0.size());
        for (size_t i = 0; i < p16.size(); ++i) p16[i] = f32_to_f16(in.pool0[i]), p32[i] = f16_to_f32(p16[i]);
        auto dp32 = upload(p32);
        auto dp16 = upload(p16);
        auto do32 = poisoned<float>(size_t(std::max<int64_t>(in.T, 1) * HD));
        auto do16 = poisoned<float>(size_t(std::max<int64_t>(in.T, 1) * HD));
        run_chunked(d, in, s, dp32.p(), do32.p(), in.T, as_variant(var));
        run_chunked(d, in, s, dp16.p(), do16.p(), in.T, as_variant(var));
        const auto o32 = do32.get(), o16 = do16.get(), s32 = dp32.get();
        const auto s16 = dp16.get();
        check_exact("kda_chunked f16 state (o)", base, o16.data(), o32.data(), size_t(in.T * HD) * 4);
        std::vector<uint16_t> want16(s32.size());
        for (size_t i = 0; i < s32.size(); ++i) want16[i] = f32_to_f16(s32[i]);
        check_exact("kda_chunked f16 state (pool)", base, s16.data(), want16.data(), want16.size() * 2);
      }
    }
  }
}

// The convenience overload (host read of cu_seqlens, stream-ordered workspace) runs the same kernels:
// bit-identical results; and a T too small for cu_seqlens computes nothing (no write past the workspace,
// outputs and states untouched).
TEST(GpuKda, ChunkedOverloadsAndWorkspaceBound) {
  need_gpu();
  Rng rng(42);
  const Shape s = kShapes[2];
  const int64_t HD = s.H * s.Dk;
  const ScanInputs in = make_inputs({5, 300, 64, 1000}, s, Gates::model, false, rng);
  const Dev4 d = upload_inputs(in);
  const std::string shape = fmt::format("mini B={} T={}", in.B, in.T);
  auto p1 = upload(in.pool0), p2 = upload(in.pool0), p3 = upload(in.pool0);
  auto o1 = poisoned<float>(size_t(in.T * HD)), o2 = poisoned<float>(size_t(in.T * HD)),
       o3 = poisoned<float>(size_t(in.T * HD));
  run_chunked(d, in, s, p1.p(), o1.p(), in.T);
  cuda::kda_chunked(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), p2.p(), o2.p(),
                    in.B, s.H, s.Dk, nullptr);
  sync();
  const auto a1 = o1.get(), a2 = o2.get(), s1 = p1.get(), s2 = p2.get();
  check_exact("kda_chunked convenience (o)", shape, a2.data(), a1.data(), a1.size() * 4);
  check_exact("kda_chunked convenience (pool)", shape, s2.data(), s1.data(), s1.size() * 4);
  // T = 64 for 1369 tokens: 1 + 4 + 1 chunk slots for 23 chunks.
  run_chunked(d, in, s, p3.p(), o3.p(), 64);
  const auto a3 = o3.get(), s3 = p3.get();
  const std::vector<float> poison = poisoned<float>(a3.size()).get();
  check_exact("kda_chunked small workspace (o untouched)", shape, a3.data(), poison.data(), a3.size() * 4);
  check_exact("kda_chunked small workspace (pool untouched)", shape, s3.data(), in.pool0.data(), s3.size() * 4);
}

// Requests are independent and the kernels deterministic: a launch over a sub-range of the packed rows
// (cu_seqlens not starting at 0, as a mixed batch would pass its prefill rows) reproduces those requests'
// outputs and states bit for bit; and a launch captured in a CUDA graph (relaxed capture, as the engine
// records its segments) and replayed gives the direct launch's results bit for bit.
TEST(GpuKda, ChunkedSubRangeAndGraphReplay) {
  need_gpu();
  Rng rng(44);
  const Shape s = kShapes[2];
  const int64_t HD = s.H * s.Dk;
  const ScanInputs in = make_inputs({70, 1, 300, 129}, s, Gates::model, false, rng);
  const Dev4 d = upload_inputs(in);
  const std::string shape = fmt::format("mini B={} T={}", in.B, in.T);
  auto p_full = upload(in.pool0);
  auto o_full = poisoned<float>(size_t(in.T * HD));
  run_chunked(d, in, s, p_full.p(), o_full.p(), in.T);
  // Requests 1..3 only: cu = {70, 71, 371, 500}, their slots.
  const std::vector<int32_t> cu_sub(in.cu.begin() + 1, in.cu.end()), slots_sub(in.slots.begin() + 1, in.slots.end());
  auto dcu_sub = upload(cu_sub);
  auto dslots_sub = upload(slots_sub);
  auto p_sub = upload(in.pool0);
  auto o_sub = poisoned<float>(size_t(in.T * HD));
  const int64_t T_sub = in.T - in.cu[1], B_sub = in.B - 1;
  auto ws = poisoned<uint8_t>(cuda::kda_chunked_workspace_bytes(T_sub, B_sub, s.H, s.Dk));
  cuda::kda_chunked(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, dcu_sub.p(), dslots_sub.p(), p_sub.p(),
                    o_sub.p(), T_sub, B_sub, s.H, s.Dk, ws.p(), nullptr);
  sync();
  const auto of = o_full.get(), os = o_sub.get(), pf = p_full.get(), ps = p_sub.get();
  const size_t r0 = size_t(in.cu[1] * HD);
  check_exact("kda_chunked sub-range (o rows)", shape, os.data() + r0, of.data() + r0, (of.size() - r0) * 4);
  const std::vector<float> poison = poisoned<float>(r0).get();
  check_exact("kda_chunked sub-range (rows before untouched)", shape, os.data(), poison.data(), r0 * 4);
  const int64_t DD = s.H * s.Dk * s.Dk;
  for (int64_t b = 0; b < in.B; ++b) {
    const size_t off = size_t(in.slots[size_t(b)] * DD);
    const float* want = b == 0 ? in.pool0.data() + off : pf.data() + off;  // request 0 was left out
    check_exact("kda_chunked sub-range (state)", shape + fmt::format(" request {}", b), ps.data() + off, want,
                size_t(DD) * 4);
  }

  // Graph: the explicit-workspace form does no host synchronisation, so it can be captured.
  cudaStream_t st;
  KCUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto p_graph = upload(in.pool0);
  auto o_graph = poisoned<float>(size_t(in.T * HD));
  auto ws2 = poisoned<uint8_t>(cuda::kda_chunked_workspace_bytes(in.T, in.B, s.H, s.Dk));
  auto p_dec = upload(in.pool0), p_dec_ref = upload(in.pool0);
  auto o_dec = poisoned<float>(size_t(in.T * HD)), o_dec_ref = poisoned<float>(size_t(in.T * HD));
  cudaGraph_t graph;
  KCUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  cuda::kda_chunked(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), p_graph.p(),
                    o_graph.p(), in.T, in.B, s.H, s.Dk, ws2.p(), st);
  cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), p_dec.p(),
                   o_dec.p(), in.B, s.H, s.Dk, st);
  KCUDA_CHECK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  KCUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KCUDA_CHECK(cudaGraphLaunch(exec, st));
  KCUDA_CHECK(cudaStreamSynchronize(st));
  cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), p_dec_ref.p(),
                   o_dec_ref.p(), in.B, s.H, s.Dk, nullptr);
  sync();
  KCUDA_CHECK(cudaGraphExecDestroy(exec));
  KCUDA_CHECK(cudaGraphDestroy(graph));
  KCUDA_CHECK(cudaStreamDestroy(st));
  const auto og = o_graph.get(), pg = p_graph.get();
  check_exact("kda_chunked graph replay (o)", shape, og.data(), of.data(), of.size() * 4);
  check_exact("kda_chunked graph replay (pool)", shape, pg.data(), pf.data(), pf.size() * 4);
  const auto od = o_dec.get(), odr = o_dec_ref.get(), pd = p_dec.get(), pdr = p_dec_ref.get();
  check_exact("kda_decode graph replay (o)", shape, od.data(), odr.data(), od.size() * 4);
  check_exact("kda_decode graph replay (pool)", shape, pd.data(), pdr.data(), pd.size() * 4);
}

// Decode: one token per request (and a varlen batch through the same contract), against kda_recurrent
// (the same FP32 math in another summation order) and the CPU oracle; both decode kernels (one block per
// item, persistent prefetching blocks) bit for bit against the default; the FP16 pool bit-for-bit against
// the FP32 launch from an FP16-representable start.
TEST(GpuKda, DecodeMatchesRecurrent) {
  need_gpu();
  Rng rng(43);
  struct Batch {
    std::vector<int32_t> lens;
    const char* what;
  };
  const Batch batches[] = {{{1}, "decode"},
                           {std::vector<int32_t>(8, 1), "decode"},
                           {std::vector<int32_t>(64, 1), "decode"},
                           {std::vector<int32_t>(257, 1), "decode"},
                           {{1, 17, 0, 130}, "varlen"}};
  for (const Shape& s : kShapes) {
    const int64_t HD = s.H * s.Dk;
    for (const Batch& bt : batches) {
      const ScanInputs in = make_inputs(bt.lens, s, Gates::model, false, rng);
      const Dev4 d = upload_inputs(in);
      const size_t no = size_t(std::max<int64_t>(in.T, 1) * HD);
      auto pd = upload(in.pool0), pr = upload(in.pool0);
      auto od = poisoned<float>(no), orr = poisoned<float>(no);
      cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), pd.p(), od.p(),
                       in.B, s.H, s.Dk, nullptr);
      cuda::kda_recurrent(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), pr.p(),
                          orr.p(), in.B, s.H, s.Dk, nullptr);
      sync();
      const auto go = od.get(), gp = pd.get(), ro = orr.get(), rp = pr.get();
      std::vector<float> pool = in.pool0;
      const auto o = cpu_scan(in, s, false, pool);
      const std::string shape = fmt::format("{} {} B={} T={} H={} Dk={}", s.what, bt.what, in.B, in.T, s.H, s.Dk);
      const double so = max_abs(o), ss = max_abs(pool);
      const Tol fp32{1e-5 * so, 1e-4, 2e-5}, fp32s{1e-5 * ss, 1e-4, 2e-5};
      // Every decode kernel explicitly: the same arithmetic in the same order, so the same bits as the default.
      for (const auto var :
           {cuda::kKdaDecodeBlocks, cuda::kKdaDecodeStream, cuda::kKdaDecodeRegs, cuda::kKdaDecodePrefetch}) {
        auto pv = upload(in.pool0);
        auto ov = poisoned<float>(no);
        cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), pv.p(),
                         ov.p(), in.B, s.H, s.Dk, nullptr, var);
        sync();
        const auto gv = ov.get(), gpv = pv.get();
        const std::string vs = shape + (var == cuda::kKdaDecodeBlocks   ? " blocks"
                                            : var == cuda::kKdaDecodeStream ? " stream"
                                            : var == cuda::kKdaDecodeRegs   ? " regs"
                                                                            : " prefetch");
        check_exact("kda_decode kernel (o) vs default", vs, gv.data(), go.data(), size_t(in.T * HD) * 4);
        check_exact("kda_decode kernel (pool) vs default", vs, gpv.data(), gp.data(), gp.size() * 4);
      }
      check("kda_decode (o) vs kda_recurrent", shape, go.data(), ro.data(), size_t(in.T * HD), fp32);
      check("kda_decode (pool) vs kda_recurrent", shape, gp.data(), rp.data(), gp.size(), fp32s);
      check("kda_decode (o) vs CPU", shape, go.data(), o.data(), size_t(in.T * HD), fp32);
      check("kda_decode (pool) vs CPU", shape, gp.data(), pool.data(), pool.size(), fp32s);
      std::vector<float> p32(in.pool0.size());
      std::vector<uint16_t> p16(in.pool0.size());
      for (size_t i = 0; i < p16.size(); ++i) p16[i] = f32_to_f16(in.pool0[i]), p32[i] = f16_to_f32(p16[i]);
      auto dp32 = upload(p32);
      auto dp16 = upload(p16);
      auto do32 = poisoned<float>(no), do16 = poisoned<float>(no);
      cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), dp32.p(),
                       do32.p(), in.B, s.H, s.Dk, nullptr);
      cuda::kda_decode(d.q.p(), d.k.p(), d.v.p(), d.g.p(), HD, d.beta.p(), s.H, d.cu.p(), d.slots.p(), dp16.p(),
                       do16.p(), in.B, s.H, s.Dk, nullptr);
      sync();
      const auto o32 = do32.get(), o16 = do16.get(), s32 = dp32.get();
      const auto s16 = dp16.get();
      check_exact("kda_decode f16 state (o)", shape, o16.data(), o32.data(), size_t(in.T * HD) * 4);
      std::vector<uint16_t> want16(s32.size());
      for (size_t i = 0; i < s32.size(); ++i) want16[i] = f32_to_f16(s32[i]);
      check_exact("kda_decode f16 state (pool)", shape, s16.data(), want16.data(), want16.size() * 2);
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest
