// The tensor-core MLA attention over paged latent caches (kernels/cuda/mla_tc.cu, through paged.h's
// mla_decode_paged and mla_prefill_paged) against the CPU twin: cpu::mla_attn_absorbed over the rows
// model::MlaCacheView::read_latent gives back (FP8 pages dequantised exactly as the kernel must).
//
// Every case: a pool of pages shared by several requests, block tables shuffled over the pool, arena bytes
// no token owns left random; query rows in one varlen launch, several rows on one request; outputs
// poisoned. Shapes: nano (Hm 4, C 64, R 16), mini (Hm 12, C 512, R 64), Hm 16, and a shape without a
// tensor-core instantiation (the CUDA-core fallback). Key counts 1, 63, 64, 65, 2047, 2048, 4100 mixed in
// one batch; sparse rows with fewer than Ksel and exactly Ksel selected; BF16 and FP8 pages; pages of
// 128, 64 and 16 tokens; tied scores (duplicated latent rows) and scores that grow or shrink along the
// context (every tile moves the running max: the online-softmax rescaling).
//
// Tolerance (bf16 MMA operands: q̃ and p rounded to bf16, relative 2^−9 each, plus ô for the prefill;
// FP32 sums in another order): relative L2 ≤ 1e-2 and per element |got − ref| ≤ 0.05·rms(ref) + |ref|/32.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "core/check.h"
#include "harness.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla_tc.h"
#include "kernels/cuda/paged.h"
#include "model/cache_view.h"

namespace kestrel::gputest {
namespace {

using kestrel::LatentFormat;

const cpu::MlaDims kTcNano{4, 32, 16, 32, 64}, kTcMini{12, 128, 64, 128, 512}, kMini16{16, 128, 64, 128, 512};
const cpu::MlaDims kOdd{4, 32, 32, 32, 128};  // C 128: no tensor-core instantiation

enum class Fill {
  random,  // ĉ, k_pe uniform in ±1.5
  dup,     // row s copies row s % 7: many exactly tied scores
  ramp,    // k_pe rises from −2 to 2 along the positions: with q_pe of one sign the scores rise (or fall)
  mags,    // every 128-column group of ĉ of every token has its own magnitude 2^U(lat_lo, lat_hi), values
           // m·u³ (u uniform in ±1; a few % of them e4m3 subnormals after the FP8 scale)
};

// Requests over one shared pool of pages (a few pages nobody owns), latent rows written by the CPU writer.
struct TcPool {
  cpu::MlaDims d;
  LatentFormat lf;
  int P;
  std::vector<int64_t> lens;
  int64_t n_pages = 3, max_blocks = 1;
  std::vector<int32_t> tables;  // i32 [requests, max_blocks], −1 past each request's blocks
  std::vector<uint8_t> lat;     // u8 [n_pages, P, token bytes]
  std::vector<std::vector<uint16_t>> rows;  // per request bf16 [lens, C+R], as read_latent returns them
  Dev<uint8_t> dlat;
  Dev<int32_t> dtables;

  TcPool(const cpu::MlaDims& d_, LatentFormat lf_, int P_, std::vector<int64_t> lens_, Fill fill, Rng& rng,
       float lat_lo = 0, float lat_hi = 0)
      : d(d_), lf(lf_), P(P_), lens(std::move(lens_)) {
    for (int64_t n : lens) max_blocks = std::max(max_blocks, (n + P - 1) / P), n_pages += (n + P - 1) / P;
    std::vector<int32_t> perm(static_cast<size_t>(n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.next() % i]);
    tables.assign(lens.size() * size_t(max_blocks), -1);
    size_t next = 0;
    for (size_t r = 0; r < lens.size(); ++r)
      for (int64_t j = 0; j < (lens[r] + P - 1) / P; ++j) tables[r * size_t(max_blocks) + size_t(j)] = perm[next++];
    lat = rand_u8(size_t(n_pages * P * gpu().latent_token_bytes()), rng, 0, 255);
    const int64_t W = d.cw();
    for (size_t r = 0; r < lens.size(); ++r) {
      const int64_t S = lens[r];
      auto x = rand_bf16(size_t(S * W), rng, -1.5f, 1.5f);
      for (int64_t s = 0; s < S; ++s) {
        if (fill == Fill::dup && s >= 7) std::copy_n(x.begin() + (s % 7) * W, W, x.begin() + s * W);
        if (fill == Fill::ramp)
          for (int64_t i = d.C; i < W; ++i)
            x[size_t(s * W + i)] = f32_to_bf16(-2.0f + 4.0f * float(s) / float(S) + rng.uniform(-0.05f, 0.05f));
        if (fill == Fill::mags)
          for (int64_t i0 = 0; i0 < d.C; i0 += 128) {
            const float m = std::exp2(rng.uniform(lat_lo, lat_hi));
            for (int64_t i = i0; i < std::min<int64_t>(i0 + 128, d.C); ++i) {
              const float u = rng.uniform(-1.0f, 1.0f);
              x[size_t(s * W + i)] = f32_to_bf16(m * u * u * u);
            }
          }
      }
      const auto v = view(r);
      for (int64_t s = 0; s < S; ++s) v.write_latent(s, x.data() + s * W);
      rows.emplace_back(size_t(S * W));
      v.read_latent(S, rows.back().data());
    }
    dlat = upload(lat);
    dtables = upload(tables);
  }
  model::MlaCacheView view(size_t r) {
    model::MlaCacheView v;
    v.latent_format = lf, v.key_format = IndexKeyFormat::bf16, v.block_size = P, v.C = d.C, v.R = d.R;
    v.latent = lat.data();
    v.block_table = std::span<const int32_t>(tables.data() + r * size_t(max_blocks), size_t((lens[r] + P - 1) / P));
    return v;
  }
  cuda::PagedMlaCache gpu() const {
    cuda::PagedMlaCache c;
    c.latent_format = kestrel::LatentFormat(int(lf)), c.block_size = P, c.C = d.C, c.R = d.R;
    c.latent = dlat.n ? dlat.p() : nullptr, c.block_tables = dtables.n ? dtables.p() : nullptr;
    c.bt_stride = max_blocks;
    return c;
  }
};

// Query rows: request, visible keys (position + 1) and, for sparse rows, the selection (Ksel slots).
struct Rows {
  std::vector<int32_t> req, lens, sel;
  int64_t Ksel = 0;
  void add(int32_t r, int64_t visible) { req.push_back(r), lens.push_back(int32_t(visible)); }
  int64_t size() const { return int64_t(req.size()); }
  // Sparse: row i keeps `count` distinct random positions of its visible ones (all of them, ascending,
  // when count ≥ visible, as the indexer hands them out), −1 padded.
  void select(int64_t Ksel_, const std::function<int64_t(int64_t i, int64_t visible)>& count, Rng& rng) {
    Ksel = Ksel_;
    sel.clear();
    for (int64_t i = 0; i < size(); ++i) {
      const int64_t vis = lens[size_t(i)], cnt = std::min(vis, count(i, vis));
      std::vector<int32_t> all(static_cast<size_t>(vis));
      std::iota(all.begin(), all.end(), 0);
      for (int64_t k = 0; k < cnt; ++k) std::swap(all[size_t(k)], all[size_t(k + int64_t(rng.next() % uint64_t(vis - k)))]);
      std::vector<int32_t> s(all.begin(), all.begin() + cnt);
      std::sort(s.begin(), s.end());
      s.resize(size_t(Ksel), -1);
      sel.insert(sel.end(), s.begin(), s.end());
    }
  }
  int64_t keys(int64_t i) const {
    if (!Ksel) return lens[size_t(i)];
    int64_t n = 0;
    while (n < Ksel && sel[size_t(i * Ksel + n)] >= 0) ++n;
    return n;
  }
};

enum class Op { decode, prefill };

// Runs one launch of `op` over `rows` on the pool and compares every row with the CPU twin. Decode: run
// again without programmatic dependent launch (mla_tc.h) and once more with it; all three bit-identical.
void run(Op op, TcPool& pool, const Rows& rows, float q_span, bool q_pe_positive, bool q_pe_negative,
         const std::string& what, Rng& rng, float q_nope_scale = 1.0f) {
  const auto& d = pool.d;
  const int64_t B = rows.size(), QK = d.qk();
  auto q = rand_bf16(size_t(B * d.Hm * QK), rng, -q_span, q_span);
  if (q_nope_scale != 1.0f)  // a power of two: exact
    for (size_t i = 0; i < q.size(); ++i)
      if (int64_t(i) % QK < d.N) q[i] = f32_to_bf16(bf16_to_f32(q[i]) * q_nope_scale);
  if (q_pe_positive || q_pe_negative)
    for (int64_t i = 0; i < B * d.Hm; ++i)
      for (int64_t e = d.N; e < QK; ++e)
        q[size_t(i * QK + e)] = f32_to_bf16((q_pe_negative ? -1.0f : 1.0f) * rng.uniform(0.5f, 1.5f));
  const auto kvb = rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng, -0.08f, 0.08f);
  std::vector<uint16_t> ref(size_t(B * d.Hm * d.Dv));
  int64_t max_keys = 1;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t S = rows.lens[size_t(i)];
    max_keys = std::max(max_keys, rows.keys(i));
    cpu::mla_attn_absorbed(d, q.data() + i * d.Hm * QK, kvb.data(), pool.rows[size_t(rows.req[size_t(i)])].data(),
                           rows.Ksel ? rows.sel.data() + i * rows.Ksel : nullptr, rows.Ksel, 1, S - 1,
                           ref.data() + i * d.Hm * d.Dv);
  }
  auto dq = upload(q);
  auto dkvb = upload(kvb);
  auto dlens = upload(rows.lens);
  auto dreq = upload(rows.req);
  auto dsel = upload(rows.sel);
  cuda::MlaPagedBatch bt;
  bt.lens = dlens.p(), bt.req = dreq.p(), bt.sel = rows.Ksel ? dsel.p() : nullptr, bt.Ksel = rows.Ksel, bt.B = B;
  bt.max_keys = max_keys;
  cuda::GemmLt lt;
  auto dout = poisoned<uint16_t>(ref.size());
  const auto cache = pool.gpu();
  if (op == Op::decode) {
    cuda::DeviceBuffer ws(cuda::mla_decode_paged_workspace_bytes(d, B, max_keys));
    cuda::mla_decode_paged(lt, d, dq.p(), dkvb.p(), cache, bt, ws.data(), dout.p(), nullptr);
    sync();
    for (bool pdl : {false, true}) {
      auto again = poisoned<uint16_t>(ref.size());
      cuda::tc::set_pdl(pdl);
      cuda::mla_decode_paged(lt, d, dq.p(), dkvb.p(), cache, bt, ws.data(), again.p(), nullptr);
      sync();
      EXPECT_TRUE(again.get() == dout.get()) << what << ": decode " << (pdl ? "repeated" : "without PDL")
                                             << " not bit-identical";
    }
    cuda::tc::set_pdl(true);
    {  // Step 5's gate in the merge launch: bit-identical to the gate kernel after the decode.
      auto g = rand_bf16(ref.size(), rng, -6.0f, 6.0f);
      g[0] = f32_to_bf16(-100.0f), g[g.size() - 1] = f32_to_bf16(100.0f);  // σ at both ends
      auto dg = upload(g);
      auto gated = poisoned<uint16_t>(ref.size());
      cuda::mla_decode_paged(lt, d, dq.p(), dkvb.p(), cache, bt, ws.data(), gated.p(), nullptr, dg.p());
      auto sep = upload(dout.get());
      cuda::sigmoid_gate_bf16(sep.p(), dg.p(), int64_t(ref.size()), nullptr);
      sync();
      EXPECT_TRUE(gated.get() == sep.get()) << what << ": the gate in the merge differs from the gate kernel";
    }
  } else {
    cuda::DeviceBuffer ws(cuda::mla_prefill_paged_workspace_bytes(d, B, max_keys));
    cuda::mla_prefill_paged(lt, d, dq.p(), dkvb.p(), cache, bt, ws.data(), dout.p(), nullptr);
    sync();
  }
  double ss = 0;
  for (uint16_t v : ref) ss += double(bf16_to_f32(v)) * bf16_to_f32(v);
  const double rms = std::sqrt(ss / double(std::max<size_t>(1, ref.size())));
  check_bf16(op == Op::decode ? "mla_decode_paged" : "mla_prefill_paged",
             fmt::format("{} {} P={} Hm={} rows={} keys<={}{}", what, format_name(pool.lf), pool.P, d.Hm, B,
                         max_keys, rows.Ksel ? " sel" : ""),
             dout.get(), ref, {0.05 * rms, 1.0 / 32, 1e-2});
}

const LatentFormat kFormats[] = {LatentFormat::bf16, LatentFormat::fp8};

TEST(GpuMlaTc, DecodeDense) {
  need_gpu();
  Rng rng(61);
  struct Case {
    cpu::MlaDims d;
    int P;
    std::vector<int64_t> lens;
    const char* what;
  };
  for (const Case& c : {Case{kTcNano, 16, {1, 63, 64, 65, 200}, "nano"}, Case{kTcNano, 128, {300, 2}, "nano"},
                        Case{kTcMini, 128, {1, 63, 64, 65, 2047, 2048, 4100}, "mini"},
                        Case{kTcMini, 64, {65, 4100, 130}, "mini"}, Case{kMini16, 128, {1, 65, 4100}, "Hm16"},
                        Case{kOdd, 16, {100, 33}, "fallback C=128"}}) {
    for (LatentFormat lf : kFormats) {
      TcPool pool(c.d, lf, c.P, c.lens, Fill::random, rng);
      Rows rows;
      for (size_t r = 0; r < c.lens.size(); ++r) rows.add(int32_t(r), c.lens[r]);
      // Speculative-style rows on the longest request: one and two tokens back.
      const size_t longest = size_t(std::max_element(c.lens.begin(), c.lens.end()) - c.lens.begin());
      rows.add(int32_t(longest), c.lens[longest] - 1);
      rows.add(int32_t(longest), c.lens[longest] - 2);
      run(Op::decode, pool, rows, 1.0f, false, false, c.what, rng);
    }
  }
}

TEST(GpuMlaTc, DecodeSparse) {
  need_gpu();
  Rng rng(62);
  struct Case {
    cpu::MlaDims d;
    int P;
    std::vector<int64_t> lens;
    int64_t Ksel;
    const char* what;
  };
  for (const Case& c : {Case{kTcNano, 128, {90, 200, 64, 5}, 64, "nano"}, Case{kTcNano, 16, {300, 65}, 64, "nano"},
                        Case{kTcMini, 128, {4100, 2048, 3000, 9000, 100}, 2048, "mini"},
                        Case{kTcMini, 64, {2049, 5000}, 2048, "mini"}, Case{kMini16, 128, {4100, 3000}, 2048, "Hm16"},
                        Case{kOdd, 16, {100, 300}, 64, "fallback C=128"}}) {
    for (LatentFormat lf : kFormats) {
      TcPool pool(c.d, lf, c.P, c.lens, Fill::random, rng);
      Rows rows;
      for (size_t r = 0; r < c.lens.size(); ++r) rows.add(int32_t(r), c.lens[r]);
      rows.add(0, c.lens[0] - 1);
      // Exactly Ksel on even rows, Ksel − 5 on odd ones (all visible keys when fewer).
      rows.select(c.Ksel, [&](int64_t i, int64_t) { return c.Ksel - (i % 2) * 5; }, rng);
      run(Op::decode, pool, rows, 1.0f, false, false, c.what, rng);
    }
  }
}

// Many rows (the split plan at B = 64), few long rows (many splits, most of them empty for the short row),
// ties and moving maxima.
TEST(GpuMlaTc, DecodeBatchesAndScores) {
  need_gpu();
  Rng rng(63);
  for (LatentFormat lf : kFormats) {
    {
      std::vector<int64_t> lens(64);
      for (auto& n : lens) n = 1 + int64_t(rng.next() % 5000);
      TcPool pool(kTcMini, lf, 128, lens, Fill::random, rng);
      Rows rows;
      for (size_t r = 0; r < lens.size(); ++r) rows.add(int32_t(r), lens[r]);
      run(Op::decode, pool, rows, 1.0f, false, false, "mini B=64 varlen", rng);
    }
    {
      TcPool pool(kTcMini, lf, 128, {20000, 5}, Fill::random, rng);
      Rows rows;
      rows.add(0, 20000), rows.add(0, 19999), rows.add(1, 5);
      run(Op::decode, pool, rows, 1.0f, false, false, "mini long + short", rng);
    }
    {
      TcPool pool(kTcMini, lf, 128, {3000, 129}, Fill::dup, rng);
      Rows rows;
      rows.add(0, 3000), rows.add(1, 129), rows.add(0, 64);
      run(Op::decode, pool, rows, 1.0f, false, false, "mini tied scores", rng);
    }
    for (bool rising : {true, false}) {
      TcPool pool(kTcMini, lf, 128, {4100, 700}, Fill::ramp, rng);
      Rows rows;
      rows.add(0, 4100), rows.add(1, 700), rows.add(0, 65);
      run(Op::decode, pool, rows, 1.0f, rising, !rising, rising ? "mini rising scores" : "mini falling scores", rng);
    }
    {
      TcPool pool(kTcNano, lf, 16, {500, 70}, Fill::ramp, rng);
      Rows rows;
      rows.add(0, 500), rows.add(1, 70);
      run(Op::decode, pool, rows, 4.0f, true, false, "nano rising scores", rng);
    }
    {
      TcPool pool(kTcMini, lf, 128, {2500, 1000}, Fill::random, rng);
      Rows rows;
      rows.add(0, 2500), rows.add(1, 1000);
      run(Op::decode, pool, rows, 6.0f, false, false, "mini peaky (q ×6)", rng);
    }
  }
}

// Small batches (q̃ on CUDA cores, merges of one or two rows per CTA with 32-, 16-, 8- and 1-split steps) and a
// batch past kAbsorbMaxRows (q̃ by cuBLASLt, eight rows per merge CTA).
TEST(GpuMlaTc, DecodeSmallAndLargeBatches) {
  need_gpu();
  Rng rng(67);
  for (LatentFormat lf : kFormats) {
    {
      TcPool pool(kTcMini, lf, 128, {1344, 4096, 700, 3200}, Fill::random, rng);
      for (int64_t r : {0, 1, 3}) {  // one row: 21 splits of 64 keys (16 + 5), 64 (32 + 32), 50 (32 + 16 + 2)
        Rows rows;
        rows.add(int32_t(r), pool.lens[size_t(r)]);
        run(Op::decode, pool, rows, 1.0f, false, false, fmt::format("mini B=1 S={}", pool.lens[size_t(r)]), rng);
      }
      Rows rows;  // 6 rows of ≤ 700 keys: 11 splits, two rows per merge CTA (8 + 3)
      for (int i = 0; i < 6; ++i) rows.add(2, 700 - 97 * i);
      run(Op::decode, pool, rows, 1.0f, false, false, "mini B=6", rng);
    }
    {
      std::vector<int64_t> lens(80);
      for (auto& n : lens) n = 1 + int64_t(rng.next() % 3000);
      TcPool pool(kTcMini, lf, 64, lens, Fill::random, rng);
      Rows rows;
      for (size_t r = 0; r < lens.size(); ++r) rows.add(int32_t(r), lens[r]);
      run(Op::decode, pool, rows, 1.0f, false, false, "mini B=80 varlen", rng);
    }
    {
      TcPool pool(kTcNano, lf, 16, {1, 2000}, Fill::random, rng);
      Rows rows;
      rows.add(1, 2000), rows.add(0, 1);
      run(Op::decode, pool, rows, 1.0f, false, false, "nano B=2", rng);
    }
  }
}

// Prefill rows: every position of a chunk of each sequence (pos0 .. pos0 + Tb − 1), several sequences per
// launch, in the engine's order (sequence by sequence).
Rows chunk_rows(const std::vector<std::pair<int64_t, int64_t>>& chunks /* (pos0, Tb) per request */) {
  Rows rows;
  for (size_t r = 0; r < chunks.size(); ++r)
    for (int64_t t = 0; t < chunks[r].second; ++t) rows.add(int32_t(r), chunks[r].first + t + 1);
  return rows;
}
std::vector<int64_t> chunk_lens(const std::vector<std::pair<int64_t, int64_t>>& chunks) {
  std::vector<int64_t> lens;
  for (const auto& [p0, Tb] : chunks) lens.push_back(p0 + Tb);
  return lens;
}

// Latent magnitudes that differ per token and 128-column group (FP8: per-key scales folded into the scores
// and into P, scales from the 2^−22 clamp to 2^14, e4m3 subnormals), with q̃ scaled to keep the scores
// moderate: ~2^−21 (f16 subnormal unless the FP8 path scales q̃) to ~2^16 (past f16's range unless scaled).
TEST(GpuMlaTc, DecodeAndPrefillMagnitudes) {
  need_gpu();
  Rng rng(68);
  struct Mag {
    float lo, hi, q;
    const char* what;
  };
  for (const Mag m : {Mag{-8, 4, 1.0f / 16, "ĉ 2^-8..2^4"}, Mag{-22, -14, 131072.0f, "ĉ 2^-22..2^-14, q×2^17"},
                      Mag{16, 22, 1.0f / 1048576, "ĉ 2^16..2^22, q×2^-20"}})
    for (LatentFormat lf : kFormats) {
      {
        TcPool pool(kTcMini, lf, 128, {4100, 700, 65}, Fill::mags, rng, m.lo, m.hi);
        Rows rows;
        rows.add(0, 4100), rows.add(1, 700), rows.add(2, 65), rows.add(0, 3000);
        run(Op::decode, pool, rows, 1.0f, false, false, fmt::format("mini {}", m.what), rng, m.q);
        rows.select(2048, [&](int64_t i, int64_t) { return 2048 - (i % 2) * 5; }, rng);
        run(Op::decode, pool, rows, 1.0f, false, false, fmt::format("mini {}", m.what), rng, m.q);
      }
      {
        TcPool pool(kTcNano, lf, 16, {300, 40}, Fill::mags, rng, m.lo, m.hi);
        Rows rows;
        rows.add(0, 300), rows.add(1, 40);
        run(Op::decode, pool, rows, 1.0f, false, false, fmt::format("nano {}", m.what), rng, m.q);
      }
      {
        const std::vector<std::pair<int64_t, int64_t>> chunks = {{0, 70}, {2000, 40}};
        TcPool pool(kTcMini, lf, 64, chunk_lens(chunks), Fill::mags, rng, m.lo, m.hi);
        run(Op::prefill, pool, chunk_rows(chunks), 1.0f, false, false, fmt::format("mini {}", m.what), rng, m.q);
      }
    }
}

TEST(GpuMlaTc, PrefillDense) {
  need_gpu();
  Rng rng(64);
  struct Case {
    cpu::MlaDims d;
    int P;
    std::vector<std::pair<int64_t, int64_t>> chunks;
    Fill fill;
    const char* what;
  };
  for (const Case& c : {Case{kTcNano, 16, {{0, 70}, {40, 30}, {130, 1}}, Fill::random, "nano"},
                        Case{kTcMini, 128, {{0, 130}, {1990, 40}, {4000, 40}}, Fill::random, "mini"},
                        Case{kTcMini, 64, {{100, 50}}, Fill::random, "mini"},
                        Case{kMini16, 128, {{0, 70}, {2000, 20}}, Fill::random, "Hm16"},
                        Case{kTcMini, 128, {{0, 200}}, Fill::ramp, "mini rising scores"},
                        Case{kOdd, 16, {{0, 40}, {50, 10}}, Fill::random, "fallback C=128"}}) {
    for (LatentFormat lf : kFormats) {
      TcPool pool(c.d, lf, c.P, chunk_lens(c.chunks), c.fill, rng);
      run(Op::prefill, pool, chunk_rows(c.chunks), 1.0f, c.fill == Fill::ramp, false, c.what, rng);
    }
  }
  // A few long rows: the plan splits their keys and the split results are merged into bf16 ô.
  for (LatentFormat lf : kFormats) {
    TcPool pool(kTcMini, lf, 128, {12000, 9001}, Fill::random, rng);
    Rows rows;
    rows.add(0, 12000), rows.add(1, 9000), rows.add(1, 9001);
    run(Op::prefill, pool, rows, 1.0f, false, false, "mini split rows", rng);
  }
}

TEST(GpuMlaTc, PrefillSparse) {
  need_gpu();
  Rng rng(65);
  struct Case {
    cpu::MlaDims d;
    int P;
    std::vector<std::pair<int64_t, int64_t>> chunks;
    int64_t Ksel;
    const char* what;
  };
  for (const Case& c : {Case{kTcNano, 16, {{0, 70}, {100, 30}}, 64, "nano"},
                        Case{kTcMini, 128, {{0, 40}, {2000, 64}, {5000, 32}}, 2048, "mini"},
                        Case{kMini16, 128, {{3000, 24}}, 2048, "Hm16"},
                        Case{kOdd, 16, {{60, 20}}, 64, "fallback C=128"}}) {
    for (LatentFormat lf : kFormats) {
      TcPool pool(c.d, lf, c.P, chunk_lens(c.chunks), Fill::random, rng);
      Rows rows = chunk_rows(c.chunks);
      // Rows past Ksel visible keys: Ksel, Ksel − 7 or Ksel − 14 selected; the others see all visible keys.
      rows.select(c.Ksel, [&](int64_t i, int64_t) { return c.Ksel - (i % 3) * 7; }, rng);
      run(Op::prefill, pool, rows, 1.0f, false, false, c.what, rng);
    }
  }
}

TEST(GpuMlaTc, RejectsTooManyHeads) {
  need_gpu();
  Rng rng(66);
  const cpu::MlaDims d{20, 128, 64, 128, 512};
  TcPool pool(d, LatentFormat::bf16, 128, {10}, Fill::random, rng);
  Rows rows;
  rows.add(0, 10);
  auto dlens = upload(rows.lens);
  cuda::MlaPagedBatch bt;
  bt.lens = dlens.p(), bt.B = 1, bt.max_keys = 10;
  auto q = upload(rand_bf16(size_t(d.Hm * d.qk()), rng, -1, 1));
  auto kvb = upload(rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng, -0.08f, 0.08f));
  auto out = poisoned<uint16_t>(size_t(d.Hm * d.Dv));
  cuda::GemmLt lt;
  cuda::DeviceBuffer ws(std::max(cuda::mla_decode_paged_workspace_bytes(d, 1, 10),
                                 cuda::mla_prefill_paged_workspace_bytes(d, 1, 10)));
  EXPECT_THROW(cuda::mla_decode_paged(lt, d, q.p(), kvb.p(), pool.gpu(), bt, ws.data(), out.p(), nullptr), Error);
  EXPECT_THROW(cuda::mla_prefill_paged(lt, d, q.p(), kvb.p(), pool.gpu(), bt, ws.data(), out.p(), nullptr), Error);
}

}  // namespace
}  // namespace kestrel::gputest
