// The tensor-core indexer (kernels/cuda/indexer.h) against its CPU twin, cpu::indexer_select_topk over the
// keys MlaCacheView::read_keys gives back (the exact dequantised BF16 keys of the same pool bytes).
//
// The GPU scores differ from the twin's by FP32 rounding only (tensor-core vs sequential order), so the
// contract is band agreement (MODEL.md §0.8, §0.12, as reference/index_agreement.py measures it). For each
// row, with an FP64 oracle of the exact scores I[s] and the error scale E[s] = Σ_h |w'_h|·Σ_i |q_h,i·k_s,i|:
//   β = (4·Di + 2·Hi + 8)·2^−24 · max_s E[s]   bounds |I_fp32 − I| for the twin and the GPU alike
//   (products of BF16 values are exact in FP32; a dot of Di terms in any order, truncating or rounding,
//   errs by ≤ 2·Di·2^−24·Σ|terms| with room to spare; ReLU is 1-Lipschitz; the head sum adds ≤ (Hi+1)·2^−24);
// thr = the Ki-th largest I. Asserted:
//   (a) every visible key with |I[s] − thr| > 2β has the twin's selection (both select it iff I[s] > thr);
//   (c) rows whose Ki-th and (Ki+1)-th exact scores differ by more than 2β select exactly the twin's set;
//   (d) exact ties go to the lower position: keys that are bit-identical (duplicated keys) and keys whose
//       every head's dot is negative beyond its error bound (a ReLU zero on both sides) tie exactly, so in
//       each such class the GPU's chosen members are a prefix in position order;
//   and structure: ascending distinct positions < lens, −1 padding exactly when lens ≤ Ki, the twin's
//   output bit for bit when lens ≤ Ki; the same bits when the keys are scored in small chunks (a bounded
//   workspace, checked with a canary after it) as in one chunk.
// (b) raw agreement |GPU ∩ twin| / Ki is reported in the summary, not required.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/indexer.h"
#include "model/cache_view.h"

namespace kestrel::gputest {
namespace {

using kestrel::IndexKeyFormat;

// Requests with their own block tables over one pool, pages handed out in a random order.
struct Pool {
  int P;
  int64_t n_pages = 3, max_blocks = 1;
  std::vector<int32_t> tables;  // i32 [requests, max_blocks]
  std::vector<int64_t> lens;
  Pool(int P_, const std::vector<int64_t>& lens_, Rng& r) : P(P_), lens(lens_) {
    for (int64_t n : lens) max_blocks = std::max(max_blocks, (n + P - 1) / P), n_pages += (n + P - 1) / P;
    std::vector<int32_t> perm(static_cast<size_t>(n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[r.next() % i]);
    tables.assign(lens.size() * size_t(max_blocks), -1);
    size_t next = 0;
    for (size_t b = 0; b < lens.size(); ++b)
      for (int64_t j = 0; j < (lens[b] + P - 1) / P; ++j) tables[b * size_t(max_blocks) + size_t(j)] = perm[next++];
  }
  model::MlaCacheView view(int64_t Di, IndexKeyFormat kf, std::vector<uint8_t>& arena, size_t b) const {
    model::MlaCacheView v;
    v.key_format = kf, v.block_size = P, v.Di = Di, v.keys = arena.data();
    v.block_table = std::span<const int32_t>(tables.data() + b * size_t(max_blocks), size_t((lens[b] + P - 1) / P));
    return v;
  }
};

int64_t key_bytes(IndexKeyFormat kf, int64_t Di) {
  return kf == IndexKeyFormat::bf16 ? 2 * Di : kf == IndexKeyFormat::fp8 ? Di + 4 : Di / 2 + Di / 32;
}

enum class KeyMode { random, dup, relu_zero };

struct Case {
  const char* what;
  int64_t Hi, Di, Ki;
  int P;
  std::vector<int64_t> lens;  // per request
  KeyMode mode = KeyMode::random;
  int dup = 0;                // KeyMode::dup: key s copies key s % dup
  int64_t chunk = 0;          // > 0: also run with a workspace that holds exactly this chunk
  bool shuffle = false;       // rows of a request not adjacent
  int prefill_rows = 3;       // extra rows per long request at positions len − {1, 7, 200}
};

// The exact-score judge of one row (see the file header); returns a description of the first failure.
struct Verdict {
  int64_t outside = 0, outside_bad = 0, gapped = 0, gapped_bad = 0, tie_bad = 0, agree = 0, rows = 0;
  int64_t twin_outside_bad = 0;
  std::string first;
};

void judge(const Case& c, const uint16_t* q /* bf16 [Hi*Di] */, const float* hw /* f32 [Hi] */,
           const std::vector<uint16_t>& keys /* bf16 [S, Di] */, int64_t S, const int32_t* got, const int32_t* ref,
           const std::string& tag, Verdict& v) {
  const int64_t Hi = c.Hi, Di = c.Di, Ki = c.Ki;
  const float scale = 1.0f / std::sqrt(float(Hi) * float(Di));
  std::vector<double> I(static_cast<size_t>(S)), E(static_cast<size_t>(S));
  std::vector<char> zero(static_cast<size_t>(S));
  std::vector<float> wp(static_cast<size_t>(Hi));
  for (int64_t h = 0; h < Hi; ++h) wp[size_t(h)] = hw[h] * scale;  // the twin's FP32 w' (hw · scale)
  const double u = std::ldexp(1.0, -24);
  // Exact-ish double scores of every key, spread over the CPU ops' thread pool (per-key results: the
  // split does not change them).
  kestrel::cpu::parallel_for(S, S * Hi * Di, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      double sum = 0, mag = 0;
      bool all_neg = true;
      for (int64_t h = 0; h < Hi; ++h) {
        double d = 0, a = 0;
        for (int64_t i = 0; i < Di; ++i) {
          const double p = double(bf16_to_f32(q[h * Di + i])) * double(bf16_to_f32(keys[size_t(s * Di + i)]));
          d += p, a += std::fabs(p);
        }
        sum += double(wp[size_t(h)]) * std::max(d, 0.0);
        mag += std::fabs(double(wp[size_t(h)])) * a;
        all_neg = all_neg && d + 4.0 * double(Di) * u * a < 0.0;  // both FP32 dots < 0: ReLU gives exactly 0
      }
      I[size_t(s)] = sum, E[size_t(s)] = mag, zero[size_t(s)] = all_neg;
    }
  });
  ++v.rows;
  std::vector<char> in_g(static_cast<size_t>(S)), in_c(static_cast<size_t>(S));
  for (int64_t i = 0; i < Ki; ++i) {
    if (got[i] >= 0 && got[i] < S) in_g[size_t(got[i])] = 1;
    if (ref[i] >= 0) in_c[size_t(ref[i])] = 1;
  }
  for (int64_t i = 0; i < Ki; ++i) v.agree += (got[i] >= 0 && got[i] < S && in_c[size_t(got[i])]) ? 1 : 0;
  const double beta = (4.0 * double(Di) + 2.0 * double(Hi) + 8.0) * u * *std::max_element(E.begin(), E.end());
  std::vector<double> sorted = I;
  std::nth_element(sorted.begin(), sorted.begin() + (Ki - 1), sorted.end(), std::greater<>());
  const double thr = sorted[size_t(Ki - 1)];
  const double next = *std::max_element(sorted.begin() + Ki, sorted.end());
  auto fail = [&](const std::string& m) {
    if (v.first.empty()) v.first = tag + ": " + m;
  };
  // (a)
  for (int64_t s = 0; s < S; ++s) {
    if (std::fabs(I[size_t(s)] - thr) <= 2 * beta) continue;
    ++v.outside;
    const bool want = I[size_t(s)] > thr;
    if (bool(in_c[size_t(s)]) != want) ++v.twin_outside_bad;  // the band itself is wrong
    if (bool(in_g[size_t(s)]) != want) {
      ++v.outside_bad;
      fail(fmt::format("key {} (I {:.9g}, thr {:.9g}, band 2β {:.3g}) {} by the GPU", s, I[size_t(s)], thr, 2 * beta,
                       want ? "dropped" : "taken"));
    }
  }
  // (c)
  if (thr - next > 2 * beta) {
    ++v.gapped;
    if (!std::equal(got, got + Ki, ref)) {
      ++v.gapped_bad;
      fail(fmt::format("threshold gap {:.3g} > 2β {:.3g} but the selection differs", thr - next, 2 * beta));
    }
  }
  // (d) classes of exact ties: each must be chosen as a prefix in position order.
  auto prefix_ok = [&](auto&& member, int64_t n_classes) {
    std::vector<char> closed(size_t(std::max<int64_t>(n_classes, 1)), 0);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k = member(s);
      if (k < 0) continue;
      if (!in_g[size_t(s)]) closed[size_t(k)] = 1;
      else if (closed[size_t(k)]) return s;
    }
    return int64_t(-1);
  };
  if (c.mode == KeyMode::dup) {
    const int64_t bad = prefix_ok([&](int64_t s) { return s % c.dup; }, c.dup);
    if (bad >= 0) ++v.tie_bad, fail(fmt::format("duplicate key {} taken after a skipped lower copy", bad));
  }
  const int64_t badz = prefix_ok([&](int64_t s) { return zero[size_t(s)] ? int64_t(0) : int64_t(-1); }, 1);
  if (badz >= 0) ++v.tie_bad, fail(fmt::format("ReLU-zero key {} taken after a skipped lower zero", badz));
}

// Structure of one output row: ascending distinct positions < len, or exactly 0..len−1 then −1.
bool row_shape_ok(const int32_t* got, int64_t len, int64_t Ki) {
  if (len <= Ki) {
    for (int64_t i = 0; i < Ki; ++i)
      if (got[i] != (i < len ? int32_t(i) : -1)) return false;
    return true;
  }
  for (int64_t i = 0; i < Ki; ++i)
    if (got[i] < 0 || got[i] >= len || (i > 0 && got[i] <= got[i - 1])) return false;
  return true;
}

const char* kname(IndexKeyFormat f) { return kestrel::format_name(f); }

Verdict run_case(const Case& c, IndexKeyFormat kf, Rng& rng) {
  const int64_t Hi = c.Hi, Di = c.Di, Ki = c.Ki;
  const Pool pool(c.P, c.lens, rng);
  const int64_t tb = key_bytes(kf, Di);
  // Fill the pool through the CPU writer; bytes no token owns stay random.
  auto arena = rand_u8(size_t(pool.n_pages * c.P * tb), rng, 0, 255);
  std::vector<float> dir(static_cast<size_t>(Di));
  for (auto& x : dir) x = (rng.next() & 1) ? 0.5f : -0.5f;
  for (size_t b = 0; b < c.lens.size(); ++b) {
    const int64_t S = c.lens[b];
    auto k = rand_bf16(size_t(S * Di), rng, -2.0f, 2.0f);
    if (c.mode == KeyMode::dup)
      for (int64_t s = c.dup; s < S; ++s) std::copy_n(k.begin() + (s % c.dup) * Di, Di, k.begin() + s * Di);
    if (c.mode == KeyMode::relu_zero)  // 4 keys in 5 point against every head's query: exact zeros
      for (int64_t s = 0; s < S; ++s)
        if (s % 5 != 0)
          for (int64_t i = 0; i < Di; ++i) k[size_t(s * Di + i)] = f32_to_bf16(-dir[size_t(i)] + rng.uniform(-0.4f, 0.4f));
    const auto v = pool.view(Di, kf, arena, b);
    for (int64_t pos = 0; pos < S; ++pos) v.write_key(pos, k.data() + pos * Di);
  }
  // Rows: each request's last position, then (long requests) a few earlier positions of it.
  std::vector<int32_t> req, lens;
  for (size_t b = 0; b < c.lens.size(); ++b) {
    req.push_back(int32_t(b)), lens.push_back(int32_t(c.lens[b]));
    const int64_t back[3] = {1, 7, 200};
    if (c.lens[b] > Ki)
      for (int i = 0; i < c.prefill_rows; ++i)
        if (c.lens[b] - back[i] > 0) req.push_back(int32_t(b)), lens.push_back(int32_t(c.lens[b] - back[i]));
  }
  if (c.shuffle)
    for (size_t i = req.size(); i > 1; --i) {
      const size_t j = size_t(rng.next() % i);
      std::swap(req[i - 1], req[j]), std::swap(lens[i - 1], lens[j]);
    }
  const int64_t T = int64_t(req.size());
  int64_t max_len = 0;
  for (int32_t n : lens) max_len = std::max<int64_t>(max_len, n);
  std::vector<float> hw;
  std::vector<uint16_t> qi;
  if (c.mode == KeyMode::relu_zero) {
    hw = rand_f32(size_t(T * Hi), rng, 0.1f, 1.0f);
    qi.resize(size_t(T * Hi * Di));
    for (size_t i = 0; i < qi.size(); ++i) qi[i] = f32_to_bf16(dir[i % size_t(Di)] + rng.uniform(-0.4f, 0.4f));
  } else {
    hw = rand_f32(size_t(T * Hi), rng, -1.0f, 2.0f);
    qi = rand_bf16(size_t(T * Hi * Di), rng, -1.0f, 1.0f);
  }

  auto dq = upload(qi);
  auto dh = upload(hw);
  auto dlens = upload(lens);
  auto dreq = upload(req);
  auto darena = upload(arena);
  auto dtables = upload(pool.tables);
  cuda::PagedMlaCache cache;
  cache.key_format = kestrel::IndexKeyFormat(int(kf)), cache.block_size = c.P, cache.Di = Di;
  cache.keys = darena.p(), cache.block_tables = dtables.p(), cache.bt_stride = pool.max_blocks;

  // One launch sequence over all rows; chunk > 0 adds a run in small chunks with a canary after the workspace.
  auto launch = [&](size_t ws_bytes, int64_t* chunk_used) {
    const size_t canary = 4096;
    std::vector<uint8_t> pattern(ws_bytes + canary, 0xA5);
    auto ws = upload(pattern);
    auto dsel = poisoned<int32_t>(size_t(T * Ki));
    std::vector<int32_t> junk(size_t(T * Ki), 0x7fffffff);  // an id never written shows up
    dsel.buf.copy_from_host(junk.data(), junk.size() * 4);
    *chunk_used = cuda::indexer_select_paged_tc_chunk(T, max_len, Ki, ws_bytes);
    cuda::indexer_select_paged_tc(dq.p(), dh.p(), cache, dlens.p(), dreq.p(), T, max_len, Hi, Ki, ws.p(), ws_bytes,
                                  dsel.p(), nullptr);
    sync();
    const auto after = ws.get();
    EXPECT_TRUE(std::all_of(after.begin() + int64_t(ws_bytes), after.end(), [](uint8_t x) { return x == 0xA5; }))
        << c.what << ": the launcher wrote past its workspace of " << ws_bytes << " bytes";
    return dsel.get();
  };
  const size_t ws_full = cuda::indexer_select_paged_tc_workspace_bytes(T, max_len, Ki);
  int64_t chunk_full = 0;
  const auto got = launch(ws_full, &chunk_full);
  EXPECT_EQ(ws_full, size_t(T * (chunk_full + Ki)) * 4) << c.what << ": workspace not bounded by T·(chunk+Ki)";
  const std::string shape = fmt::format("{} keys {} Hi={} Di={} k={} P={} T={} max_len={}", c.what, kname(kf), Hi, Di,
                                        Ki, c.P, T, max_len);
  // Determinism, and the chunked merge against one chunk: the same bits.
  check_exact("indexer_tc repeat", shape, launch(ws_full, &chunk_full).data(), got.data(), got.size() * 4);
  if (c.chunk > 0) {
    const size_t ws_small = size_t(T * (Ki + c.chunk)) * 4;
    int64_t chunk_small = 0;
    const auto got_small = launch(ws_small, &chunk_small);
    EXPECT_EQ(chunk_small, c.chunk) << c.what;
    EXPECT_LT(chunk_small, max_len) << c.what << ": the chunked run must take several chunks";
    check_exact(fmt::format("indexer_tc {} chunks of {}", (max_len + chunk_small - 1) / chunk_small, chunk_small),
                shape, got_small.data(), got.data(), got.size() * 4);
  }

  Verdict v;
  int64_t shape_bad = 0, short_bad = 0;
  std::vector<uint16_t> keys;
  std::vector<int32_t> ref(static_cast<size_t>(Ki));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t S = lens[size_t(t)];
    const int32_t* g = got.data() + t * Ki;
    if (!row_shape_ok(g, S, Ki)) {
      ++shape_bad;
      if (v.first.empty()) v.first = fmt::format("row {} (len {}) malformed: first ids {} {} {}", t, S, g[0], g[1], g[2]);
      continue;
    }
    keys.resize(size_t(S * Di));
    pool.view(Di, kf, arena, size_t(req[size_t(t)])).read_keys(S, keys.data());
    cpu::indexer_select_topk(qi.data() + t * Hi * Di, keys.data(), hw.data() + t * Hi, 1, S - 1, Hi, Di, Ki, ref.data());
    if (S <= Ki) {
      short_bad += std::equal(g, g + Ki, ref.begin()) ? 0 : 1;
      continue;
    }
    judge(c, qi.data() + t * Hi * Di, hw.data() + t * Hi, keys, S, g, ref.data(), fmt::format("row {} len {}", t, S), v);
  }
  const bool ok = shape_bad == 0 && short_bad == 0 && v.outside_bad == 0 && v.gapped_bad == 0 && v.tie_bad == 0 &&
                  v.twin_outside_bad == 0;
  note(fmt::format("{:<28} {:<60} agreement {:.4f} over {} rows; outside band {} keys, {} wrong; gapped rows {}, {} "
                   "wrong; tie-prefix violations {}; {}",
                   "indexer_tc (band)", shape, v.rows ? double(v.agree) / double(v.rows * Ki) : 1.0, v.rows, v.outside,
                   v.outside_bad, v.gapped, v.gapped_bad, v.tie_bad, ok ? "PASS" : "FAIL"));
  EXPECT_EQ(shape_bad, 0) << shape << ": " << v.first;
  EXPECT_EQ(short_bad, 0) << shape << ": rows with lens ≤ Ki differ from the twin";
  EXPECT_EQ(v.twin_outside_bad, 0) << shape << ": the twin itself breaks the band (oracle or band wrong)";
  EXPECT_EQ(v.outside_bad, 0) << shape << ": " << v.first;
  EXPECT_EQ(v.gapped_bad, 0) << shape << ": " << v.first;
  EXPECT_EQ(v.tie_bad, 0) << shape << ": " << v.first;
  return v;
}

constexpr IndexKeyFormat kAll[] = {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4, IndexKeyFormat::bf16};
constexpr IndexKeyFormat kQuant[] = {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4};

TEST(GpuIndexerTc, Nano) {
  need_gpu();
  Rng rng(71);
  const std::vector<Case> cases = {
      {"nano mixed", 2, 32, 64, 64, {1, 63, 64, 65, 5000, 40000}},
      {"nano P=16", 2, 32, 64, 16, {5, 100, 61, 300}},
      {"nano dup", 2, 32, 64, 128, {300, 129, 5000}, KeyMode::dup, 7},
      {"nano relu zeros", 2, 32, 64, 128, {300, 2000}, KeyMode::relu_zero},
      {"nano chunked shuffled", 2, 32, 64, 64, {5000, 40000, 65, 1, 700}, KeyMode::random, 0, 128, true},
  };
  int64_t gapped = 0;
  for (const Case& c : cases)
    for (IndexKeyFormat kf : kAll) gapped += run_case(c, kf, rng).gapped;
  // Short rows and few heads leave clear threshold gaps: the exact-equality check (c) must have run.
  EXPECT_GT(gapped, 0) << "no nano row had a threshold gap wider than the band";
}

TEST(GpuIndexerTc, Di64Hi20) {
  need_gpu();
  Rng rng(72);
  const Case c{"Hi=20 Di=64", 20, 64, 256, 64, {1, 255, 256, 257, 5000, 40000}, KeyMode::random, 0, 1024};
  for (IndexKeyFormat kf : kAll) run_case(c, kf, rng);
}

TEST(GpuIndexerTc, Mini) {
  need_gpu();
  Rng rng(73);
  for (IndexKeyFormat kf : kAll) run_case({"mini mixed", 32, 128, 2048, 128, {1, 2047, 2048, 2049, 5000, 40000}}, kf, rng);
  for (IndexKeyFormat kf : kQuant) run_case({"mini P=64", 32, 128, 2048, 64, {2049, 5000, 9000}}, kf, rng);
  for (IndexKeyFormat kf : kAll)
    run_case({"mini dup", 32, 128, 2048, 128, {5000, 3000}, KeyMode::dup, 1000}, kf, rng);
  for (IndexKeyFormat kf : kQuant)
    run_case({"mini relu zeros", 32, 128, 2048, 128, {5000, 9000}, KeyMode::relu_zero}, kf, rng);
  for (IndexKeyFormat kf : kQuant)
    run_case({"mini chunked", 32, 128, 2048, 128, {40000, 5000, 2049}, KeyMode::random, 0, 4096, true}, kf, rng);
}

// Many decode rows of different requests and lengths in one launch (groups of 8 rows mix requests).
TEST(GpuIndexerTc, MiniManyRows) {
  need_gpu();
  Rng rng(74);
  std::vector<int64_t> lens(40);
  for (auto& n : lens) n = 1 + int64_t(rng.next() % 12000);
  Case c{"mini B=40 varlen", 32, 128, 2048, 128, lens};
  c.prefill_rows = 0;
  run_case(c, IndexKeyFormat::fp8, rng);
  c.shuffle = true;
  run_case(c, IndexKeyFormat::mxfp4, rng);
}

// A long context: the running top-k over 19 chunks of 16K keys equals one 300K-key chunk, and the twin.
TEST(GpuIndexerTc, LongContext) {
  need_gpu();
  Rng rng(75);
  Case c{"long 300K", 32, 128, 2048, 128, {300000, 150000}, KeyMode::random, 0, 16384};
  c.prefill_rows = 1;
  run_case(c, IndexKeyFormat::fp8, rng);
}

}  // namespace
}  // namespace kestrel::gputest
