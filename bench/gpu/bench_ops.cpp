// Roofline benchmark of the CUDA ops at one TP8 rank's K3.1 shapes (hidden 7168, 12 KDA heads × 128,
// 12 MLA heads, 32 indexer heads × 128, latent 3584, expert intermediate 3072, 896 experts top-16).
// Per op and batch (and context for attention): median time over timed repetitions (CUDA events, after
// warm-ups), the bytes it must move and the FLOPs it must do, achieved GB/s and TFLOP/s, next to the
// ceilings measured in the same run (device-to-device copy, large cuBLASLt BF16 GEMM) and the
// ANCHORS.md figure. Inputs are random (never zeros). Optional: `--model DIR` times one decode step of
// that checkpoint at batch 1 and 64 through the GPU executor's batched path (CudaModel::forward_batch
// over a paged cache), split by op group, with the wall time of eager and graph-replayed steps.
//
// Paged sections (kernels/cuda/paged.h): MLA decode over a paged BF16/FP8 latent cache and indexer select over
// paged FP8/MXFP4 keys, every request's block table pointing into one shared page pool (pages reused
// across requests when B·S exceeds it, as the contiguous rows are), and the chunked KDA prefill scan.
//
//   bench_ops [--quick] [--perf] [--model DIR] [--quantization bf16|ptpc-fp8] [--only SECTION,...]
//     sections: ceilings (always measured; printed as PERF copy_gbps / bf16_gemm_tflops) proj attnres kda route argmax sample moe mla indexer
//               paged_mla paged_indexer kda_chunked model
//     --perf: quick repetitions, PERF lines, and only ceilings + model unless --only says otherwise
//     --quantization ptpc-fp8: the model section on FP8 dense projections (PERF keys suffixed _fp8)
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_ref.h"  // tests/gpu/ref: the reference kernels (baselines)
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_skinny.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/vision.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "request/request.h"
#include "vision/cuda/vision_cuda.h"

using namespace kestrel;

namespace {

// Random bytes on the device in [lo, lo+span): a splitmix hash per byte, filled on the host in 64 MiB pieces.
void fill_random(void* d, size_t n, uint8_t lo, uint8_t span, uint64_t seed) {
  const size_t piece = size_t(64) << 20;
  std::vector<uint8_t> h(std::min(n, piece));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < h.size(); ++i) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h[i] = uint8_t(lo + (z ^ (z >> 31)) % span);
  }
  for (size_t off = 0; off < n; off += piece)
    KCUDA_CHECK(cudaMemcpy(static_cast<char*>(d) + off, h.data(), std::min(piece, n - off), cudaMemcpyHostToDevice));
}
// bf16 values uniform-ish in ±[2^-3, 2^1): sign, exponent 124..127, random mantissa.
void fill_bf16(void* d, size_t n_elems, uint64_t seed) {
  std::vector<uint16_t> h(std::min<size_t>(n_elems, size_t(32) << 20));
  std::mt19937_64 r(seed);
  for (auto& x : h) {
    const uint64_t z = r();
    x = uint16_t(((z & 1) << 15) | ((124 + (z >> 1) % 4) << 7) | ((z >> 8) & 0x7f));
  }
  for (size_t off = 0; off < n_elems; off += h.size())
    KCUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(d) + off, h.data(), std::min(h.size(), n_elems - off) * 2,
                           cudaMemcpyHostToDevice));
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    KCUDA_CHECK(cudaEventCreate(&a));
    KCUDA_CHECK(cudaEventCreate(&b));
  }
  double median_us(const std::function<void()>& fn, int warm, int reps) {
    for (int i = 0; i < warm; ++i) fn();
    KCUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      KCUDA_CHECK(cudaEventRecord(a));
      fn();
      KCUDA_CHECK(cudaEventRecord(b));
      KCUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.0);
    }
    KCUDA_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }  // µs per launch of `launch(st)` issued `reps` times in a row into one CUDA graph, replayed (warm, then reps2
  // timed): the launches' own cost without the host's, each waiting for the one before (PDL where they use it).
  double graph_us(cudaStream_t st, int reps, const std::function<void(cudaStream_t)>& launch, int warm, int reps2) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    KCUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < reps; ++i) launch(st);
    KCUDA_CHECK(cudaStreamEndCapture(st, &g));
    KCUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    const double us = median_us([&] { KCUDA_CHECK(cudaGraphLaunch(ge, st)); }, warm, reps2) / double(reps);
    KCUDA_CHECK(cudaGraphExecDestroy(ge));
    KCUDA_CHECK(cudaGraphDestroy(g));
    return us;
  }

};

double g_bw = 0, g_tflops = 0;  // measured ceilings: GB/s, TFLOP/s

void header(const std::string& title) {
  fmt::print("\n### {}\n\n| op | shape | µs | bytes | GFLOP | GB/s | TFLOP/s | % of copy BW | % of GEMM rate | anchor µs |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n",
             title);
}
void row(const std::string& op, const std::string& shape, double us, double bytes, double flops,
         const std::string& anchor) {
  const double gbs = bytes / us / 1e3, tf = flops / us / 1e6;
  fmt::print("| {} | {} | {:.1f} | {:.3g} | {:.3g} | {:.0f} | {:.1f} | {:.0f}% | {:.1f}% | {} |\n", op, shape, us, bytes,
             flops / 1e9, gbs, tf, 100 * gbs / g_bw, 100 * tf / g_tflops, anchor);
  std::fflush(stdout);
}

}  // namespace

// Bytes and FLOPs of the reduced-mini step, from the config (the same shapes the GPU model uploads).
struct StepCounts {
  double dense_params = 0;   // dense projection weights per token (all of them are read at any batch)
  double expert_params = 0;  // per token: the selected experts (K of X per MoE layer)
  double unhit_expert_bytes_b1 = 0;  // expert bytes a batch-1 step does not read ((X − K) per MoE layer)
  double state_bytes_b1 = 0;         // KDA state + conv history read and written by one sequence
};
static StepCounts count_step(const TextConfig& t, bool fp8) {
  StepCounts c;
  const double D = t.hidden_size, H = t.kda.num_heads, Dk = t.kda.head_dim, HD = H * Dk, Q = t.q_lora_rank,
               C = t.kv_lora_rank, R = t.qk_rope_head_dim, Hm = t.num_attention_heads, N = t.qk_nope_head_dim,
               Dv = t.v_head_dim, Hi = t.index_n_heads, Di = t.index_head_dim, X = t.num_experts,
               K = t.num_experts_per_token, Lt = t.routed_expert_hidden_size, I = t.moe_intermediate_size,
               Is = t.shared_intermediate(), F = t.intermediate_size;
  const double expert_bytes = 3.0 * I * Lt * (0.5 + 1.0 / 32);  // MXFP4 codes + e8m0 scales
  for (int L = 0; L < t.num_hidden_layers; ++L) {
    if (t.attn_kind[size_t(L)] == AttnKind::kda) {
      c.dense_params += D * (4 * HD + Dk + H) + HD * Dk + D * HD;
      c.state_bytes_b1 += 2.0 * (H * Dk * Dk * 4 + (t.kda.conv_size - 1) * 3 * HD * 2);
    } else {
      c.dense_params += D * (Q + C + R + Hm * Dv) + Q * Hm * (N + R) + D * Hm * Dv;
      if (t.has_indexer()) c.dense_params += D * (Di + Hi) + Q * Hi * Di;
    }
    if (t.mlp_kind[size_t(L)] == MlpKind::dense) {
      c.dense_params += 3 * D * F;
    } else {
      c.dense_params += D * X + 2 * D * Lt + 3 * D * Is;
      c.expert_params += K * 3 * Lt * I;
      c.unhit_expert_bytes_b1 += (X - K) * expert_bytes;
    }
  }
  (void)fp8;
  return c;
}

// One decode step of a real checkpoint, split by op group, through the GPU executor's path
// (CudaModel::forward_batch over a paged cache): B requests, each with a context of `ctx` tokens
// prefilled, then one decode token each; batch 1 and 64 side by side. Eager (no CUDA graphs), so the
// events between op groups time every launch; the wall time of a graph-replayed step is printed too.
// Then an 8K-token prefill of one sequence. PERF lines (suffix _fp8 with --quantization ptpc-fp8):
//   decode_step_mini_us_b1 / _b64   graph-replayed step, median wall time (host prep, sync, argmax included)
//   decode_step_mini_ahead_us_b1 / _b64   graph steps run ahead (async scheduling): step N+1 enqueued with its
//                                   tokens fed from step N's device ids before step N's ids are taken; median
//                                   wall time per step
//   decode_step_mini_pipelined_us_b1 / _b64   20 graph steps queued back to back, one argmax + sync: the
//                                   GPU's time per step with the host's share overlapped
//   decode_step_mini_floor_us       bytes a batch-1 step must read (the weights less the experts it does not
//                                   select, + KDA state/history read and written + the MLA context read) ÷ the
//                                   copy rate measured in this run
//   prefill_mini_tok_s_8k, prefill_mini_pct_bf16_peak   8192 tokens in one forward; model FLOPs (2·active
//                                   params per token + MLA/indexer/KDA attention work) ÷ time ÷ the BF16 GEMM
//                                   rate measured in this run
static void decode_step(const std::string& model_dir, bool fp8, bool perf) {
  {
    const ModelConfig cfg = load_config(model_dir);
    const Checkpoint ckpt(model_dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    model::CudaModelOptions mo;
    mo.quant = fp8 ? model::WeightQuant::ptpc_fp8 : model::WeightQuant::bf16;
    model::CudaModel m(cfg, w, mo);
    const TextConfig& tc = cfg.text;
    const std::string sfx = fp8 ? "_fp8" : "";
    const int64_t ctx = 512, Bmax = 64;
    const int P = 64;
    const int64_t pages_per = (ctx + 1 + P - 1) / P;
    auto cache = m.new_cache(int32_t(Bmax * pages_per), int32_t(Bmax),
                             CacheFormats{P, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(Bmax));
    for (int64_t b = 0; b < Bmax; ++b)
      for (int64_t i = 0; i < pages_per; ++i) tables[size_t(b)].push_back(int32_t(b * pages_per + i));
    std::vector<int32_t> prompt(static_cast<size_t>(ctx));
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919 + 13) % 8000 % tc.vocab_size);
    std::vector<int32_t> tok(size_t(Bmax), 17);
    struct Res {
      double median_us, graph_us, pipelined_us, ahead_us;
      std::vector<std::pair<std::string, double>> ops;
    };
    std::map<int64_t, Res> res;
    const int reps = perf ? 10 : 20;
    for (int64_t B : {int64_t(1), Bmax}) {
      for (int64_t b = 0; b < B; ++b) {
        m.zero_slot(*cache, int32_t(b));
        model::CudaSeq q{prompt, 0, int32_t(b), tables[size_t(b)], model::CudaSeq::Logits::none};
        m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
      }
      std::vector<model::CudaSeq> seqs;
      for (int64_t b = 0; b < B; ++b)
        seqs.push_back({std::span<const int32_t>(&tok[size_t(b)], 1), ctx, int32_t(b), tables[size_t(b)],
                        model::CudaSeq::Logits::last});
      std::vector<int32_t> ids(static_cast<size_t>(B));
      std::vector<double> step;
      for (int i = 0; i < reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        m.forward_batch(*cache, seqs);  // the same position each time: the timing, not the text, matters
        m.greedy(ids.data());
        step.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(step.begin(), step.end());
      m.enable_op_timing(true);
      m.forward_batch(*cache, seqs);
      m.enable_op_timing(false);
      // The same step through the CUDA graph bucket: one capture run, then timed replays.
      m.enable_cuda_graphs(true);
      m.forward_batch(*cache, seqs);
      std::vector<double> gstep, gfwd;
      for (int i = 0; i < 2 * reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        m.forward_batch(*cache, seqs);
        const auto t1 = std::chrono::steady_clock::now();
        m.greedy(ids.data());
        gstep.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        gfwd.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      // The host's share: forward_batch returns once the step's inputs are uploaded and its graph launched.
      std::sort(gfwd.begin(), gfwd.end());
      fmt::print("graph step B = {}: forward_batch returns after {:.1f} µs (median host time to launch)\n", B,
                 gfwd[gfwd.size() / 2]);
      // Back to back: N replays queued, one argmax and sync at the end — the GPU's time per step when the host
      // work of step N+1 overlaps step N (what the wall time above would be with host preparation overlapped).
      std::vector<double> pstep;
      for (int r = 0; r < 5; ++r) {
        const int n = 20;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; ++i) m.forward_batch(*cache, seqs);
        m.greedy(ids.data());
        pstep.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n);
      }
      // Run-ahead (the engine's loop under --async-scheduling, runtime/executor_cuda.h): each step enqueued with
      // its tokens taken from the previous step's ids on the device (CudaSeq::prev_id), then the previous step's
      // ids taken; wall time per step, one step always in flight.
      const int32_t placeholder = -1;
      std::vector<model::CudaSeq> aseqs = seqs;
      for (int64_t b = 0; b < B; ++b) aseqs[size_t(b)].tokens = {&placeholder, 1}, aseqs[size_t(b)].prev_id = int32_t(b);
      std::vector<cuda::SampleParams> gp;
      for (int64_t b = 0; b < B; ++b) gp.push_back({int32_t(b), 0, 0.0f, 1.0f, 0.0f, 0, 0});
      m.forward_batch(*cache, seqs);
      int64_t ticket = m.sample_ahead(gp);
      std::vector<double> astep;
      for (int i = 0; i < 2 * reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        m.forward_batch(*cache, aseqs);
        const int64_t next = m.sample_ahead(gp);
        m.take_ids(ticket, ids.data());
        ticket = next;
        astep.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      m.take_ids(ticket, ids.data());
      fmt::print("graph step B = {}: run ahead (tokens fed on the device) {:.1f} µs a step (median)\n", B,
                 [&] { auto a = astep; std::sort(a.begin(), a.end()); return a[a.size() / 2]; }());
      m.enable_cuda_graphs(false);
      std::sort(gstep.begin(), gstep.end());
      std::sort(pstep.begin(), pstep.end());
      std::sort(astep.begin(), astep.end());
      res[B] = {step[step.size() / 2], gstep[gstep.size() / 2], pstep[pstep.size() / 2], astep[astep.size() / 2],
                m.op_times()};
    }
    // The batch-1 floor: bytes that must be read once.
    const StepCounts sc = count_step(tc, fp8);
    const double weights = double(m.weight_bytes());
    const double embed_unread = w.lm_head.empty() ? 0.0 : double(tc.vocab_size) * tc.hidden_size * 2;  // one row read
    double mla_ctx_bytes = 0;
    for (int L = 0; L < tc.num_hidden_layers; ++L)
      if (tc.attn_kind[size_t(L)] != AttnKind::kda)
        mla_ctx_bytes += double(ctx + 1) * (2.0 * (tc.kv_lora_rank + tc.qk_rope_head_dim) +
                                            (tc.has_indexer() ? 2.0 * tc.index_head_dim : 0.0));
    const double floor_bytes = weights - sc.unhit_expert_bytes_b1 - embed_unread + sc.state_bytes_b1 + mla_ctx_bytes;
    const double floor_us = floor_bytes / (g_bw * 1e3);
    fmt::print("\n### One decode step of {} ({} layers, {} experts, vocab {}; weights {:.2f} GB on the GPU, {}), context "
               "{} per request, paged cache (P = {}), CudaModel::forward_batch + device argmax\n\n"
               "median step wall time ({} steps, host prep + sync + argmax included): eager batch 1 {:.0f} µs, batch {} "
               "{:.0f} µs ({:.0f} tokens/s); CUDA graphs batch 1 {:.0f} µs, batch {} {:.0f} µs ({:.0f} tokens/s); graphs queued back to back (one sync per 20 "
               "steps) batch 1 {:.0f} µs, batch {} {:.0f} µs.\n"
               "batch-1 floor: {:.3f} GB read ({:.3f} GB weights − {:.3f} GB unselected experts − {:.3f} GB unread "
               "embeddings + {:.4f} GB state/context) ÷ {:.0f} GB/s = {:.0f} µs; graph step = {:.2f} × floor; batch 64 = "
               "{:.2f} × batch 1.\n\n"
               "One eager step with CUDA events between op groups (µs, summed over layers):\n\n"
               "| op group | batch 1 | batch {} |\n|---|---|---|\n",
               model_dir, tc.num_hidden_layers, tc.num_experts, tc.vocab_size, weights / 1e9,
               fp8 ? "ptpc-fp8" : "bf16", ctx, P, reps, res[1].median_us, Bmax, res[Bmax].median_us,
               double(Bmax) / res[Bmax].median_us * 1e6, res[1].graph_us, Bmax, res[Bmax].graph_us,
               double(Bmax) / res[Bmax].graph_us * 1e6, res[1].pipelined_us, Bmax, res[Bmax].pipelined_us, floor_bytes / 1e9, weights / 1e9, sc.unhit_expert_bytes_b1 / 1e9,
               embed_unread / 1e9, (sc.state_bytes_b1 + mla_ctx_bytes) / 1e9, g_bw, floor_us, res[1].graph_us / floor_us,
               res[Bmax].graph_us / res[1].graph_us, Bmax);
    double t1 = 0, t64 = 0;
    for (size_t i = 0; i < res[1].ops.size(); ++i) {
      const double b64 = i < res[Bmax].ops.size() ? res[Bmax].ops[i].second : 0.0;
      fmt::print("| {} | {:.1f} | {:.1f} |\n", res[1].ops[i].first, res[1].ops[i].second, b64);
      t1 += res[1].ops[i].second, t64 += b64;
    }
    fmt::print("| total (GPU time between events) | {:.1f} | {:.1f} |\n\n", t1, t64);
    fmt::print("PERF decode_step_mini_us_b1{} {:.1f}\nPERF decode_step_mini_us_b64{} {:.1f}\n"
               "PERF decode_step_mini_floor_us{} {:.1f}\nPERF decode_step_mini_eager_us_b1{} {:.1f}\n"
               "PERF decode_step_mini_eager_us_b64{} {:.1f}\nPERF decode_step_mini_pipelined_us_b1{} {:.1f}\n"
               "PERF decode_step_mini_pipelined_us_b64{} {:.1f}\nPERF decode_step_mini_ahead_us_b1{} {:.1f}\n"
               "PERF decode_step_mini_ahead_us_b64{} {:.1f}\n",
               sfx, res[1].graph_us, sfx, res[Bmax].graph_us, sfx, floor_us, sfx, res[1].median_us, sfx,
               res[Bmax].median_us, sfx, res[1].pipelined_us, sfx, res[Bmax].pipelined_us, sfx, res[1].ahead_us, sfx,
               res[Bmax].ahead_us);
    std::fflush(stdout);

    // ---- an 8K-token prefill of one sequence ----
    const int64_t Tp = 8192;
    const int64_t pages = (Tp + P - 1) / P;
    if (pages <= Bmax * pages_per) {
      std::vector<int32_t> table(static_cast<size_t>(pages));
      std::iota(table.begin(), table.end(), 0);
      std::vector<int32_t> ptoks(static_cast<size_t>(Tp));
      for (int64_t i = 0; i < Tp; ++i) ptoks[size_t(i)] = int32_t((i * 7919 + 29) % 8000 % tc.vocab_size);
      std::vector<double> ts;
      for (int i = 0; i < (perf ? 3 : 5); ++i) {
        m.zero_slot(*cache, 0);
        model::CudaSeq q{ptoks, 0, 0, table, model::CudaSeq::Logits::last};
        const auto t0 = std::chrono::steady_clock::now();
        m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
        int32_t next = 0;
        m.greedy(&next);  // waits for the step: forward_batch returns before the GPU is done
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (i > 0) ts.push_back(us);  // the first run allocates scratch and plans cuBLASLt
      }
      std::sort(ts.begin(), ts.end());
      const double us = ts[ts.size() / 2];
      // Model FLOPs: 2·(dense + selected expert params) per token, plus per token at position p: MLA scores and
      // values over the attended keys (min(p+1, index_topk) with an indexer), the indexer over p+1 keys, the
      // absorbed q̃ / output maps through kv_b, and the chunked KDA scan (bench_ops' kda_chunked count).
      double attn = 0;
      const double Hm = tc.num_attention_heads, C = tc.kv_lora_rank, R = tc.qk_rope_head_dim,
                   Dk = tc.kda.head_dim, H = tc.kda.num_heads;
      for (int L = 0; L < tc.num_hidden_layers; ++L) {
        if (tc.attn_kind[size_t(L)] == AttnKind::kda) {
          attn += double(Tp) * H * 2.0 * (64.0 * Dk + 3.0 * Dk * Dk + 64.0 * Dk);
          continue;
        }
        attn += double(Tp) * 2.0 * Hm * (tc.qk_nope_head_dim * C + tc.v_head_dim * C);
        for (int64_t p = 0; p < Tp; ++p) {
          const double seen = double(p + 1);
          const double keys = tc.has_indexer() ? std::min(seen, double(tc.index_topk)) : seen;
          attn += 2.0 * Hm * (C + R + C) * keys;
          if (tc.has_indexer()) attn += 2.0 * tc.index_n_heads * tc.index_head_dim * seen;
        }
      }
      const double flops = 2.0 * (sc.dense_params + sc.expert_params) * double(Tp) + attn +
                           2.0 * double(tc.vocab_size) * tc.hidden_size;
      const double tok_s = double(Tp) / us * 1e6, pct = 100.0 * flops / (us * 1e-6) / (g_tflops * 1e12);
      fmt::print("8K prefill ({} tokens, one sequence, {}): median {:.0f} µs = {:.0f} tokens/s; {:.2f} TFLOP of model "
                 "work = {:.1f} TFLOP/s, {:.1f} % of the BF16 GEMM rate measured ({:.0f} TFLOP/s)\n",
                 Tp, fp8 ? "ptpc-fp8" : "bf16", us, tok_s, flops / 1e12, flops / us / 1e6, pct, g_tflops);
      fmt::print("PERF prefill_mini_tok_s_8k{} {:.0f}\nPERF prefill_mini_pct_bf16_peak{} {:.2f}\n", sfx, tok_s, sfx, pct);
      // Where the prefill's time goes: one more run with CUDA events between op groups.
      {
        m.zero_slot(*cache, 0);
        model::CudaSeq q{ptoks, 0, 0, table, model::CudaSeq::Logits::last};
        m.enable_op_timing(true);
        m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
        m.enable_op_timing(false);
        fmt::print("\n8K prefill with CUDA events between op groups (µs, summed over layers):\n\n| op group | µs |\n|---|---|\n");
        double tot = 0;
        for (const auto& [name, t] : m.op_times()) fmt::print("| {} | {:.1f} |\n", name, t), tot += t;
        fmt::print("| total | {:.1f} |\n\n", tot);
      }
      std::fflush(stdout);
    }
  }
}

int main(int argc, char** argv) {
  bool quick = false, perf = false, fp8 = false;
  std::string model_dir, only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--perf")) perf = quick = true;
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model_dir = argv[++i];
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    if (!std::strcmp(argv[i], "--quantization") && i + 1 < argc) {
      const std::string q = argv[++i];
      if (q != "bf16" && q != "ptpc-fp8") {
        fmt::print(stderr, "--quantization: bf16 or ptpc-fp8\n");
        return 2;
      }
      fp8 = q == "ptpc-fp8";
    }
  }
  if (perf && only.empty()) only = "ceilings,model";  // --perf: the scoreboard's numbers, quickly
  auto want = [&](const char* section) {
    if (only.empty()) return true;
    const std::string o = "," + only + ",", s = "," + std::string(section) + ",";
    return o.find(s) != std::string::npos;
  };
  cudaDeviceProp prop{};
  KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  fmt::print("device: {} ({} SMs, {:.1f} GiB)\n", prop.name, prop.multiProcessorCount,
             double(prop.totalGlobalMem) / (1 << 30));
  Timer tm;
  cuda::GemmLt lt;
  const int64_t D = 7168;
  const std::vector<int64_t> batches = {1, 8, 64, 256};

  // ---- ceilings ---------------------------------------------------------------------------------------------
  {
    const size_t n = size_t(4) << 30;
    cuda::DeviceBuffer a(n), b(n);
    fill_random(a.data(), n, 0, 255, 1);
    const double us = tm.median_us([&] { KCUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice)); }, 2, 10);
    g_bw = 2.0 * double(n) / us / 1e3;
    const int64_t M = 8192;
    cuda::DeviceBuffer x(size_t(M * M) * 2), w(size_t(M * M) * 2), y(size_t(M * M) * 2);
    fill_bf16(x.data(), size_t(M * M), 2);
    fill_bf16(w.data(), size_t(M * M), 3);
    const double gus = tm.median_us([&] {
      lt.bf16(static_cast<uint16_t*>(x.data()), M, static_cast<uint16_t*>(w.data()), static_cast<uint16_t*>(y.data()), M,
              M, M, M, nullptr);
    }, 3, 20);
    g_tflops = 2.0 * double(M) * M * M / gus / 1e6;
    fmt::print("ceilings measured now: device-to-device copy {:.0f} GB/s (4 GiB, read+write); cuBLASLt BF16 GEMM "
               "8192^3 {:.0f} TFLOP/s (random data)\n", g_bw, g_tflops);
    fmt::print("PERF copy_gbps {:.1f}\nPERF bf16_gemm_tflops {:.1f}\n", g_bw, g_tflops);
  }

  // ---- dense projections (cuBLASLt; T = 1 also the hand GEMV) -------------------------------------------------
  if (want("proj")) {
    header("BF16 projections, one layer, TP8 rank (cuBLASLt)");
    struct G {
      const char* name;
      int64_t K, N;
      const char* anchor;
    };
    const std::vector<G> gs = {{"KDA q|k|v", D, 3 * 1536, "—"},   {"KDA/MLA o_proj", 1536, D, "—"},
                               {"MLA q_a", D, 1536, "—"},          {"MLA q_b", 1536, 12 * 192, "—"},
                               {"indexer wq_b", 1536, 32 * 128, "—"}, {"MoE latent down", D, 3584, "—"},
                               {"MoE latent up", 3584, D, "—"},    {"7168x7168 (anchor)", D, D, "28.8 (m=1)"}};
    const int64_t maxK = D, maxN = 3 * 1536 > D ? 3 * 1536 : D;
    cuda::DeviceBuffer part(cuda::kSkinnyPartBytes), counters(size_t(cuda::kSkinnyCounters) * 4);
    KCUDA_CHECK(cudaMemset(counters.data(), 0, counters.size()));
    const cuda::SkinnyWorkspace skinny_ws{static_cast<float*>(part.data()), part.size(),
                                          static_cast<unsigned*>(counters.data()), cuda::kSkinnyCounters};
    cuda::DeviceBuffer x(size_t(256 * maxK) * 2), y(size_t(256 * maxN) * 4);
    fill_bf16(x.data(), size_t(256 * maxK), 4);
    // Rotate among weight copies so the 50 MB L2 does not serve repeated reads.
    for (const G& g : gs) {
      const int copies = 4;
      cuda::DeviceBuffer w(size_t(copies * g.K * g.N) * 2);
      fill_bf16(w.data(), size_t(copies * g.K * g.N), 5);
      for (int64_t B : batches) {
        int it = 0;
        const double us = tm.median_us([&] {
          lt.bf16(static_cast<uint16_t*>(x.data()), g.K, static_cast<uint16_t*>(w.data()) + (it++ % copies) * g.K * g.N,
                  static_cast<uint16_t*>(y.data()), g.N, B, g.K, g.N, nullptr);
        }, 5, quick ? 20 : 50);
        const double bytes = 2.0 * (g.K * g.N + B * g.K + B * g.N), flops = 2.0 * B * g.K * g.N;
        row(g.name, fmt::format("B={} {}→{}", B, g.K, g.N), us, bytes, flops, B == 1 ? g.anchor : "—");
        if (B <= cuda::kSkinnyMaxT) {  // the decode path's skinny GEMM (kernels/cuda/gemm_skinny.h)
          it = 0;
          cuda::GemmSegs sg;
          sg.seg[0] = {0, y.data(), g.N, cuda::GemmEpi::bf16, nullptr, 0};
          sg.n = 1;
          const double sus = tm.median_us([&] {
            cuda::gemm_skinny_bf16(static_cast<uint16_t*>(x.data()), g.K,
                                   static_cast<uint16_t*>(w.data()) + (it++ % copies) * g.K * g.N, B, g.K, g.N, sg,
                                   skinny_ws, nullptr);
          }, 5, quick ? 20 : 50);
          row(std::string(g.name) + " (skinny)", fmt::format("B={} {}→{}", B, g.K, g.N), sus, bytes, flops, "—");
          if (B > 16) {  // and the wide GEMM, which takes 17–64 rows on the decode path (gemm_wide.cu)
            it = 0;
            const double wus = tm.median_us([&] {
              cuda::gemm_wide_bf16(static_cast<uint16_t*>(x.data()), g.K,
                                   static_cast<uint16_t*>(w.data()) + (it++ % copies) * g.K * g.N, B, g.K, g.N, sg,
                                   skinny_ws, nullptr);
            }, 5, quick ? 20 : 50);
            row(std::string(g.name) + " (wide)", fmt::format("B={} {}→{}", B, g.K, g.N), wus, bytes, flops, "—");
          }
        }
        if (B == 1) {
          it = 0;
          const double gus = tm.median_us([&] {
            cuda::gemv_bf16(static_cast<uint16_t*>(x.data()), static_cast<uint16_t*>(w.data()) + (it++ % copies) * g.K * g.N,
                            static_cast<uint16_t*>(y.data()), nullptr, g.K, g.N, nullptr);
          }, 5, quick ? 20 : 50);
          row(std::string(g.name) + " (GEMV)", fmt::format("B=1 {}→{}", g.K, g.N), gus, bytes, flops, g.anchor);
        }
      }
    }
  }

  // ---- AttnRes points: the one-CTA and the cluster kernel by batch (kernels/cuda/attn_res.cu) ----------------
  // Twenty dependent points in one CUDA graph (PDL edges, as in the forward), replayed: µs per point. The
  // crossover sets attn_res.cu's default bound; both kernels are timed whatever it is.
  if (want("attnres")) {
    const int64_t nb = 4, Tmax = 64, reps = 20;
    fmt::print("\n### AttnRes point (attn_res_step), D = {}, {} stored blocks, P += a, store off, FP8 codes on: "
               "µs per point, {} points in one graph\n\n| T | one-CTA kernel | cluster kernel |\n|---|---|---|\n",
               D, nb, reps);
    cuda::DeviceBuffer blocks(size_t(nb * Tmax * D) * 2), partial(size_t(Tmax * D) * 2), av(size_t(Tmax * D) * 2),
        y(size_t(Tmax * D) * 2), q8(size_t(Tmax * D)), qs(size_t(Tmax) * 4), wv(size_t(3 * D) * 2);
    fill_bf16(blocks.data(), size_t(nb * Tmax * D), 11);
    fill_bf16(partial.data(), size_t(Tmax * D), 12);
    fill_bf16(av.data(), size_t(Tmax * D), 13);
    fill_bf16(wv.data(), size_t(3 * D), 14);
    const auto* w16 = static_cast<const uint16_t*>(wv.data());
    cudaStream_t st;
    KCUDA_CHECK(cudaStreamCreate(&st));  // blocking: orders with the timer's events on the legacy stream
    const int saved = cuda::attn_res_cluster_max_t();
    for (int64_t T : {1, 2, 4, 8, 16, 32, 64}) {
      double us[2];
      for (int k = 0; k < 2; ++k) {
        cuda::set_attn_res_cluster_max_t(k == 0 ? 0 : 64);
        us[k] = tm.graph_us(st, reps, [&](cudaStream_t st) {
          cuda::attn_res_step(static_cast<const uint16_t*>(blocks.data()), T * D, int(nb),
                              static_cast<uint16_t*>(partial.data()), static_cast<const uint16_t*>(av.data()),
                              cuda::AttnResAdd::add, nullptr, w16, w16 + D, w16 + 2 * D, 1e-6f,
                              static_cast<uint16_t*>(y.data()), static_cast<uint8_t*>(q8.data()),
                              static_cast<float*>(qs.data()), T, D, st);
        }, 3, quick ? 10 : 30);
      }
      fmt::print("| {} | {:.2f} | {:.2f} |\n", T, us[0], us[1]);
      if (perf) fmt::print("PERF attn_res_us_b{} {:.2f}\nPERF attn_res_cluster_us_b{} {:.2f}\n", T, us[0], T, us[1]);
    }
    cuda::set_attn_res_cluster_max_t(saved);
    KCUDA_CHECK(cudaStreamDestroy(st));
  }

  // ---- KDA recurrent decode --------------------------------------------------------------------------------
  if (want("kda")) {
    header("KDA decode core (recurrent delta rule), H=12, Dk=128, FP32 state in place");
    const int64_t H = 12, Dk = 128, HD = H * Dk;
    const int anchors_s[] = {0, 0, 0, 0};
    (void)anchors_s;
    const char* anchor[] = {"6.4 / 7.2", "7.5 / 7.4", "36.7 / 31.2", "136.6 / 115.7"};
    for (size_t bi = 0; bi < batches.size(); ++bi) {
      const int64_t B = batches[bi];
      cuda::DeviceBuffer pool(size_t(B * H * Dk * Dk) * 4), io(size_t(5 * B * HD) * 4), beta(size_t(B * H) * 4),
          cu(size_t(B + 1) * 4), slots(size_t(B) * 4);
      fill_random(pool.data(), pool.size(), 0, 64, 6);  // small positive floats (exponent bits < 64 → tiny)
      // q, k, v, g: |x| ≤ 1, g negative (decay); beta in (0, 1).
      std::vector<float> h(size_t(5 * B * HD));
      std::mt19937 r(7);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (size_t i = 0; i < h.size(); ++i) h[i] = i >= size_t(3 * B * HD) && i < size_t(4 * B * HD) ? -0.05f * (1 + u(r)) : 0.1f * u(r);
      KCUDA_CHECK(cudaMemcpy(io.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      std::vector<float> hb(size_t(B * H), 0.5f);
      KCUDA_CHECK(cudaMemcpy(beta.data(), hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
      std::vector<int32_t> hc(size_t(B + 1)), hs(static_cast<size_t>(B));
      std::iota(hc.begin(), hc.end(), 0);
      std::iota(hs.begin(), hs.end(), 0);
      KCUDA_CHECK(cudaMemcpy(cu.data(), hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
      KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
      KCUDA_CHECK(cudaMemset(pool.data(), 0, pool.size()));
      float* f = static_cast<float*>(io.data());
      const double us = tm.median_us([&] {
        cuda::kda_recurrent(f, f + B * HD, f + 2 * B * HD, f + 3 * B * HD, HD, static_cast<float*>(beta.data()), H,
                            static_cast<int32_t*>(cu.data()), static_cast<int32_t*>(slots.data()),
                            static_cast<float*>(pool.data()), f + 4 * B * HD, B, H, Dk, nullptr);
      }, 5, quick ? 20 : 50);
      const double bytes = 2.0 * B * H * Dk * Dk * 4 + 5.0 * B * HD * 4;
      const double flops = double(B) * H * Dk * Dk * 8;
      row("kda_recurrent", fmt::format("B={}", B), us, bytes, flops, anchor[bi]);
    }
  }

  // ---- MoE router -----------------------------------------------------------------------------------------
  if (want("route")) {
    const int reps = 20;
    fmt::print("\n### MoE router (moe_route): µs per launch, {} dependent launches in one graph (PDL)\n\n"
               "| X | K | T | block kernel | two-level kernel | sort kernel | radix kernel |\n|---|---|---|---|---|---|---|\n",
               reps);
    cudaStream_t st;
    KCUDA_CHECK(cudaStreamCreate(&st));  // blocking: orders with the timer's events on the legacy stream
    const cuda::MoeRouteKernel saved = cuda::moe_route_kernel();
    for (auto [X, K] : {std::pair<int64_t, int64_t>{112, 2}, {112, 8}, {896, 4}, {896, 8}, {896, 16}})
      for (int64_t T : {1, 8, 64}) {
        std::vector<float> h(size_t(T * X));
        std::mt19937_64 r(uint64_t(X * 100 + T));
        for (auto& v : h) v = float(int64_t(r() % 8001) - 4000) / 1000.0f;
        cuda::DeviceBuffer lg(h.size() * 4), bias(size_t(X) * 4), ids(size_t(T * K) * 4), wts(size_t(T * K) * 4);
        KCUDA_CHECK(cudaMemcpy(lg.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
        KCUDA_CHECK(cudaMemset(bias.data(), 0, size_t(X) * 4));
        double us[4];
        for (int k = 0; k < 4; ++k) {
          cuda::set_moe_route_kernel(k == 0   ? cuda::MoeRouteKernel::block
                                     : k == 1 ? cuda::MoeRouteKernel::two_level
                                     : k == 2 ? cuda::MoeRouteKernel::sort
                                              : cuda::MoeRouteKernel::radix);
          us[k] = tm.graph_us(st, reps, [&](cudaStream_t st) {
            cuda::moe_route(static_cast<const float*>(lg.data()), static_cast<const float*>(bias.data()), T, X, K,
                            true, 2.5f, static_cast<int32_t*>(ids.data()), static_cast<float*>(wts.data()), st);
          }, 3, quick ? 10 : 30);
        }
        fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |\n", X, K, T, us[0], us[1], us[2], us[3]);
        if (perf)
          fmt::print("PERF route_block_us_x{0}_k{1}_b{2} {3:.2f}\nPERF route_2l_us_x{0}_k{1}_b{2} {4:.2f}\n"
                     "PERF route_sort_us_x{0}_k{1}_b{2} {5:.2f}\nPERF route_radix_us_x{0}_k{1}_b{2} {6:.2f}\n",
                     X, K, T, us[0], us[1], us[2], us[3]);
      }
    cuda::set_moe_route_kernel(saved);
    KCUDA_CHECK(cudaStreamDestroy(st));
  }

  // ---- greedy argmax ---------------------------------------------------------------------------------------
  if (want("argmax")) {
    const int reps = 20;
    const int64_t V = 163840;  // the real vocabulary
    fmt::print("\n### Greedy argmax (argmax_rows, V = {}): µs per launch, {} dependent launches in one graph\n\n"
               "| rows | one CTA a row | split over CTAs |\n|---|---|---|\n", V, reps);
    cudaStream_t st;
    KCUDA_CHECK(cudaStreamCreate(&st));  // blocking: orders with the timer's events on the legacy stream
    cuda::DeviceBuffer ws(cuda::argmax_workspace_bytes());
    KCUDA_CHECK(cudaMemset(ws.data(), 0, cuda::argmax_workspace_bytes()));
    for (int64_t n : {1, 8, 64}) {
      std::vector<float> h(size_t(n * V));
      std::mt19937_64 r{uint64_t(n)};
      for (auto& v : h) v = float(int64_t(r() % 8001) - 4000) / 1000.0f;
      cuda::DeviceBuffer lg(h.size() * 4), ids(size_t(n) * 4);
      KCUDA_CHECK(cudaMemcpy(lg.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      double us[2];
      for (int k = 0; k < 2; ++k) {
        us[k] = tm.graph_us(st, reps, [&](cudaStream_t st) {
          cuda::argmax_rows(static_cast<const float*>(lg.data()), V, n, V, static_cast<int32_t*>(ids.data()), st,
                            k == 0 ? nullptr : ws.data());
        }, 3, quick ? 10 : 30);
      }
      fmt::print("| {} | {:.2f} | {:.2f} |\n", n, us[0], us[1]);
      if (perf) fmt::print("PERF argmax_row_us_b{0} {1:.2f}\nPERF argmax_split_us_b{0} {2:.2f}\n", n, us[0], us[1]);
    }
    KCUDA_CHECK(cudaStreamDestroy(st));
  }

  // ---- the device sampler ------------------------------------------------------------------------------------
  // sample_rows (one CTA a row) with the knobs a chat client sends, beside the greedy argmax above: what a sampled
  // decode step pays after its graph (never measured before session 34 put it here).
  if (want("sample")) {
    const int reps = 10;
    const int64_t V = 163840;
    struct Knobs {
      const char* name;
      int32_t top_k;
      float temperature, top_p, min_p;
    };
    const Knobs knobs[] = {{"T=0.7", 0, 0.7f, 1.0f, 0.0f},
                           {"T=0.7 top_p=0.95", 0, 0.7f, 0.95f, 0.0f},
                           {"T=0.7 top_k=50", 50, 0.7f, 1.0f, 0.0f},
                           {"T=1 min_p=0.05", 0, 1.0f, 1.0f, 0.05f}};
    fmt::print("\n### Device sampler (sample_rows, V = {}): µs per launch, {} dependent launches in one graph\n\n"
               "| rows | knobs | µs |\n|---|---|---|\n", V, reps);
    cudaStream_t st;
    KCUDA_CHECK(cudaStreamCreate(&st));  // blocking: orders with the timer's events on the legacy stream
    for (int64_t n : {1, 8, 64}) {
      std::vector<float> h(size_t(n * V));
      std::mt19937_64 r{uint64_t(n + 7)};
      for (auto& v : h) v = float(int64_t(r() % 16001) - 8000) / 1000.0f;  // logits in [−8, 8]
      cuda::DeviceBuffer lg(h.size() * 4), ids(size_t(n) * 4), prm(size_t(n) * sizeof(cuda::SampleParams));
      KCUDA_CHECK(cudaMemcpy(lg.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      for (const Knobs& k : knobs) {
        std::vector<cuda::SampleParams> ps(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i)
          ps[size_t(i)] = {int32_t(i), k.top_k, k.temperature, k.top_p, k.min_p, 1234u, uint64_t(i)};
        KCUDA_CHECK(cudaMemcpy(prm.data(), ps.data(), ps.size() * sizeof(cuda::SampleParams), cudaMemcpyHostToDevice));
        const double us = tm.graph_us(st, reps, [&](cudaStream_t st) {
          cuda::sample_rows(static_cast<const float*>(lg.data()), V, V, static_cast<const cuda::SampleParams*>(prm.data()),
                            n, static_cast<int32_t*>(ids.data()), st);
        }, 2, quick ? 5 : 15);
        fmt::print("| {} | {} | {:.1f} |\n", n, k.name, us);
        if (perf) fmt::print("PERF sample_us_b{}_knobs{} {:.1f}\n", n, &k - knobs, us);  // knobs: the table's order
      }
    }
    KCUDA_CHECK(cudaStreamDestroy(st));
  }

  // ---- MoE experts ----------------------------------------------------------------------------------------
  if (want("moe")) {
    const int64_t X = 896, K = 16, Lt = 3584, I = 3072;
    const int64_t p13 = I * Lt / 2, s13 = I * Lt / 32, p2 = Lt * I / 2, s2 = Lt * I / 32;
    const size_t total = size_t(X) * size_t(2 * p13 + 2 * s13 + p2 + s2);
    header(fmt::format("MoE routed experts, MXFP4 W4A16, 896 experts top-16, Lt 3584, I 3072 ({:.1f} GB of expert "
                       "weights on the GPU)", double(total) / 1e9));
    cuda::DeviceBuffer w1p(size_t(X * p13)), w3p(size_t(X * p13)), w2p(size_t(X * p2)), w1s(size_t(X * s13)),
        w3s(size_t(X * s13)), w2s(size_t(X * s2));
    fill_random(w1p.data(), w1p.size(), 0, 255, 8);
    fill_random(w3p.data(), w3p.size(), 0, 255, 9);
    fill_random(w2p.data(), w2p.size(), 0, 255, 10);
    fill_random(w1s.data(), w1s.size(), 118, 6, 11);  // scales 2^-9..2^-4: finite, realistic outputs
    fill_random(w3s.data(), w3s.size(), 118, 6, 12);
    fill_random(w2s.data(), w2s.size(), 118, 6, 13);
    const cuda::MoeExpertWeights mw{static_cast<uint8_t*>(w1p.data()), static_cast<uint8_t*>(w1s.data()),
                                    static_cast<uint8_t*>(w3p.data()), static_cast<uint8_t*>(w3s.data()),
                                    static_cast<uint8_t*>(w2p.data()), static_cast<uint8_t*>(w2s.data()),
                                    p13, s13, p2, s2, cuda::kMoeExpertLayout};  // random bytes: any layout
    const char* anchor[] = {"72", "177", "844", "862"};
    for (size_t bi = 0; bi < batches.size(); ++bi) {
      const int64_t B = batches[bi];
      std::mt19937 r(uint32_t(14 + B));
      std::vector<int32_t> ids(size_t(B * K));
      std::vector<float> wts(size_t(B * K), 1.0f / K);
      std::vector<char> used(size_t(X), 0);
      for (int64_t t = 0; t < B; ++t) {
        std::vector<int32_t> perm(static_cast<size_t>(X));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), r);
        for (int64_t k = 0; k < K; ++k) ids[size_t(t * K + k)] = perm[size_t(k)], used[size_t(perm[size_t(k)])] = 1;
      }
      const int64_t distinct = std::accumulate(used.begin(), used.end(), int64_t(0));
      cuda::DeviceBuffer dz(size_t(B * Lt) * 2), dids(ids.size() * 4), dw(wts.size() * 4), dut(size_t(B * Lt) * 2),
          ws(cuda::moe_experts_workspace_bytes(B, X, K, Lt, I));
      fill_bf16(dz.data(), size_t(B * Lt), 15);
      KCUDA_CHECK(cudaMemcpy(dids.data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      KCUDA_CHECK(cudaMemcpy(dw.data(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
      const double us = tm.median_us([&] {
        cuda::moe_experts_mxfp4(static_cast<uint16_t*>(dz.data()), static_cast<int32_t*>(dids.data()),
                                static_cast<float*>(dw.data()), mw, B, X, K, Lt, I, 4.0f, 25.0f, ws.data(),
                                static_cast<uint16_t*>(dut.data()), nullptr);
      }, 3, quick ? 10 : 30);
      const double bytes = double(distinct) * double(2 * p13 + 2 * s13 + p2 + s2) + 4.0 * B * Lt;
      const double flops = 2.0 * B * K * (2 * I * Lt + Lt * I);
      row("moe_experts_mxfp4", fmt::format("B={} ({} experts hit)", B, distinct), us, bytes, flops, anchor[bi]);
    }
  }

  // ---- MLA absorbed decode (dense and sparse) ---------------------------------------------------------------
  if (want("mla")) {
    const cpu::MlaDims d{12, 128, 64, 128, 512};
    const int64_t CW = d.cw();
    header("MLA absorbed decode (q̃ GEMM + split-KV attention + combine + W_UV), 12 heads, BF16 latent cache [S, 576]");
    const std::vector<int64_t> ctxs = quick ? std::vector<int64_t>{8192, 32768} : std::vector<int64_t>{8192, 32768, 131072};
    const int64_t max_rows = 256 * int64_t(32768);  // 9.7 GB: the largest B×S run below; bigger ones wrap
    cuda::DeviceBuffer cache(size_t(max_rows * CW) * 2);
    fill_bf16(cache.data(), size_t(max_rows * CW), 16);
    cuda::DeviceBuffer q(size_t(256 * d.Hm * d.qk()) * 2), kvb(size_t(d.Hm * (d.N + d.Dv) * d.C) * 2),
        o(size_t(256 * d.Hm * d.Dv) * 2);
    fill_bf16(q.data(), size_t(256 * d.Hm * d.qk()), 17);
    fill_bf16(kvb.data(), size_t(d.Hm * (d.N + d.Dv) * d.C), 18);
    for (bool sparse : {false, true}) {
      for (int64_t S : ctxs) {
        for (int64_t B : batches) {
          if (!sparse && B * S > max_rows * 4) continue;  // > 39 GB of cache per call: skipped
          // Requests share cache rows when B·S exceeds the buffer (each reads its own S rows either way; only
          // L2 reuse could differ, and 9.7 GB is 200× the L2).
          std::vector<const uint16_t*> ptrs(static_cast<size_t>(B));
          for (int64_t b = 0; b < B; ++b)
            ptrs[size_t(b)] = static_cast<uint16_t*>(cache.data()) + ((b * S) % std::max<int64_t>(1, max_rows - S + 1)) * CW;
          std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(S));
          const int64_t Ksel = 2048;
          std::vector<int32_t> sel;
          if (sparse) {
            std::mt19937 r(19);
            for (int64_t b = 0; b < B; ++b) {
              std::vector<int32_t> s;
              for (int64_t i = 0; i < Ksel; ++i) s.push_back(int32_t(r() % uint32_t(S)));
              std::sort(s.begin(), s.end());
              sel.insert(sel.end(), s.begin(), s.end());
            }
          }
          cuda::DeviceBuffer dptr(ptrs.size() * 8), dlens(lens.size() * 4), dsel(std::max<size_t>(1, sel.size()) * 4);
          KCUDA_CHECK(cudaMemcpy(dptr.data(), ptrs.data(), ptrs.size() * 8, cudaMemcpyHostToDevice));
          KCUDA_CHECK(cudaMemcpy(dlens.data(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
          if (sparse) KCUDA_CHECK(cudaMemcpy(dsel.data(), sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
          const int64_t keys = sparse ? Ksel : S;
          const cuda::MlaDecodeBatch bt{static_cast<const uint16_t* const*>(dptr.data()),
                                        static_cast<int32_t*>(dlens.data()),
                                        sparse ? static_cast<int32_t*>(dsel.data()) : nullptr, Ksel, B, keys};
          cuda::DeviceBuffer ws(cuda::mla_decode_workspace_bytes(d, B, keys));
          const int reps = B * keys * CW * 2 > (int64_t(4) << 30) ? 5 : (quick ? 10 : 30);
          const double us = tm.median_us([&] {
            cuda::mla_decode_absorbed(lt, d, static_cast<uint16_t*>(q.data()), static_cast<uint16_t*>(kvb.data()), bt,
                                      ws.data(), static_cast<uint16_t*>(o.data()), nullptr);
          }, 2, reps);
          const double bytes = double(B) * keys * CW * 2 + 2.0 * d.Hm * (d.N + d.Dv) * d.C;
          const double flops = double(B) * d.Hm * (keys * (CW + d.C) * 2.0 + 2.0 * d.N * d.C + 2.0 * d.Dv * d.C);
          std::string anchor = "—";
          if (!sparse && S == 32768) anchor = B == 1 ? "29" : B == 8 ? "91" : B == 64 ? "563" : "2188";
          if (!sparse && S == 32768) anchor += " (16 heads)";
          row(sparse ? "mla_decode sparse top-2048" : "mla_decode dense", fmt::format("B={} S={}", B, S), us, bytes,
              flops, anchor);
        }
      }
    }
  }

  // ---- Indexer (scores + top-2048), one launch pair per request -------------------------------------------------
  if (want("indexer")) {
    header("Indexer select: exact-order FP32 scores (32 heads × 128) + radix top-2048, per request");
    const int64_t Hi = 32, Di = 128, Ki = 2048;
    const std::vector<int64_t> ctxs = quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 32768, 131072};
    for (int64_t S : ctxs) {
      for (int64_t B : batches) {
        if (B * S > int64_t(8) << 20 && B > 8) continue;  // keep the run inside the lease
        cuda::DeviceBuffer keys(size_t(B * S * Di) * 2), qi(size_t(B * Hi * Di) * 2), hw(size_t(B * Hi) * 4),
            scores(size_t(B * S) * 4), sel(size_t(B * Ki) * 4);
        fill_bf16(keys.data(), size_t(B * S * Di), 20);
        fill_bf16(qi.data(), size_t(B * Hi * Di), 21);
        std::vector<float> h(size_t(B * Hi));
        std::mt19937 r(22);
        for (auto& x : h) x = float(r() % 1000) / 500.0f - 0.5f;
        KCUDA_CHECK(cudaMemcpy(hw.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
        const double us = tm.median_us([&] {
          for (int64_t b = 0; b < B; ++b)
            cuda::indexer_select(static_cast<uint16_t*>(qi.data()) + b * Hi * Di,
                                 static_cast<uint16_t*>(keys.data()) + b * S * Di, static_cast<float*>(hw.data()) + b * Hi,
                                 1, S - 1, Hi, Di, Ki, static_cast<float*>(scores.data()) + b * S, S,
                                 static_cast<int32_t*>(sel.data()) + b * Ki, nullptr);
        }, 2, quick ? 5 : 15);
        const double bytes = double(B) * S * (Di * 2 + 4 + 5 * 4);  // keys, score write, 5 score passes of top-k
        const double flops = double(B) * S * Hi * (2.0 * Di + 3);
        row("indexer_select", fmt::format("B={} S={}", B, S), us, bytes, flops, S == 32768 ? "(DSA module 168/201/346/762)" : "—");
      }
    }
  }


  const std::vector<int64_t> ctxs_all = quick ? std::vector<int64_t>{8192, 32768} : std::vector<int64_t>{8192, 32768, 131072};
  // A shared page pool for the paged sections; request b's block j is page (b·blocks + j) mod pool pages.
  const int P = 128;
  auto tables_for = [&](int64_t B, int64_t S, int64_t pool_pages) {
    const int64_t nb = (S + P - 1) / P;
    std::vector<int32_t> t(static_cast<size_t>(B * nb));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < nb; ++j) t[size_t(b * nb + j)] = int32_t((b * nb + j) % pool_pages);
    return t;
  };

  // ---- paged MLA decode ----------------------------------------------------------------------------------
  if (want("paged_mla")) {
    const cpu::MlaDims d{12, 128, 64, 128, 512};
    cuda::DeviceBuffer q(size_t(256 * d.Hm * d.qk()) * 2), kvb(size_t(d.Hm * (d.N + d.Dv) * d.C) * 2),
        o(size_t(256 * d.Hm * d.Dv) * 2);
    fill_bf16(q.data(), size_t(256 * d.Hm * d.qk()), 31);
    fill_bf16(kvb.data(), size_t(d.Hm * (d.N + d.Dv) * d.C), 32);
    const int64_t pool_tokens = int64_t(8) << 20;  // 8M tokens: 9.7 GB BF16 / 5.5 GB FP8
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      cuda::PagedMlaCache c;
      c.latent_format = lf, c.block_size = P, c.C = d.C, c.R = d.R;
      const int64_t tb = c.latent_token_bytes();
      cuda::DeviceBuffer arena(size_t(pool_tokens * tb)), rows(size_t(65536 * d.cw()) * 2), slots(65536 * 8);
      // Fill through the writer (so FP8 pages hold real scales): 64K random rows written over the pool.
      fill_bf16(rows.data(), size_t(65536 * d.cw()), 33);
      {
        std::vector<int64_t> hs(65536);
        c.latent = static_cast<uint8_t*>(arena.data());
        for (int64_t off = 0; off < pool_tokens; off += 65536) {
          std::iota(hs.begin(), hs.end(), off);
          KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), hs.size() * 8, cudaMemcpyHostToDevice));
          cuda::paged_write_latent(c, static_cast<uint16_t*>(rows.data()), d.cw(), static_cast<int64_t*>(slots.data()),
                                   65536, nullptr);
        }
        KCUDA_CHECK(cudaDeviceSynchronize());
      }
      header(fmt::format("Paged MLA absorbed decode, 12 heads, {} latent ({} B/token), block 128, block tables into "
                         "one 8M-token pool",
                         lf == LatentFormat::bf16 ? "BF16" : "FP8", tb));
      {
        // The writer itself, one decode step's worth of rows.
        for (int64_t B : batches) {
          const double us = tm.median_us([&] {
            cuda::paged_write_latent(c, static_cast<uint16_t*>(rows.data()), d.cw(), static_cast<int64_t*>(slots.data()),
                                     B, nullptr);
          }, 3, 20);
          row("paged_write_latent", fmt::format("B={}", B), us, double(B) * (d.cw() * 2 + tb + 8), 0, "—");
        }
      }
      for (bool sparse : {false, true}) {
        for (int64_t S : ctxs_all) {
          for (int64_t B : batches) {
            if (double(B) * S * tb > 40e9) continue;  // > 40 GB of cache traffic per call
            const auto tables = tables_for(B, S, pool_tokens / P);
            std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(S)), sel;
            const int64_t Ksel = 2048;
            if (sparse) {
              std::mt19937 r(34);
              for (int64_t b = 0; b < B; ++b) {
                std::vector<int32_t> s;
                for (int64_t i = 0; i < Ksel; ++i) s.push_back(int32_t(r() % uint32_t(S)));
                std::sort(s.begin(), s.end());
                sel.insert(sel.end(), s.begin(), s.end());
              }
            }
            cuda::DeviceBuffer dt(tables.size() * 4), dl(lens.size() * 4), ds(std::max<size_t>(1, sel.size()) * 4);
            KCUDA_CHECK(cudaMemcpy(dt.data(), tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
            KCUDA_CHECK(cudaMemcpy(dl.data(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
            if (sparse) KCUDA_CHECK(cudaMemcpy(ds.data(), sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
            c.block_tables = static_cast<int32_t*>(dt.data()), c.bt_stride = (S + P - 1) / P;
            cuda::MlaPagedBatch bt;
            bt.lens = static_cast<int32_t*>(dl.data()), bt.sel = sparse ? static_cast<int32_t*>(ds.data()) : nullptr;
            bt.Ksel = Ksel, bt.B = B;
            const int64_t keys = sparse ? Ksel : S;
            bt.max_keys = keys;
            cuda::DeviceBuffer ws(cuda::mla_decode_paged_workspace_bytes(d, B, keys));
            const int reps = double(B) * keys * tb > 4e9 ? 5 : (quick ? 10 : 20);
            const double us = tm.median_us([&] {
              cuda::mla_decode_paged(lt, d, static_cast<uint16_t*>(q.data()), static_cast<uint16_t*>(kvb.data()), c, bt,
                                     ws.data(), static_cast<uint16_t*>(o.data()), nullptr);
            }, 2, reps);
            const double bytes = double(B) * keys * (tb + 4.0 / P) + 2.0 * d.Hm * (d.N + d.Dv) * d.C;
            const double flops = double(B) * d.Hm * (keys * (d.cw() + d.C) * 2.0 + 2.0 * d.N * d.C + 2.0 * d.Dv * d.C);
            std::string anchor = "—";
            if (!sparse && S == 32768) anchor = B == 1 ? "29" : B == 8 ? "91" : B == 64 ? "563" : "2188";
            if (!sparse && S == 32768) anchor += " (BF16, 16 heads)";
            row(sparse ? "mla_decode_paged sparse top-2048" : "mla_decode_paged dense", fmt::format("B={} S={}", B, S),
                us, bytes, flops, anchor);
          }
        }
      }
    }
  }

  // ---- paged indexer select --------------------------------------------------------------------------------
  if (want("paged_indexer")) {
    const int64_t Hi = 32, Di = 128, Ki = 2048;
    const int64_t pool_tokens = int64_t(8) << 20;
    cuda::DeviceBuffer qi(size_t(256 * Hi * Di) * 2), hw(size_t(256 * Hi) * 4), sel(size_t(256 * Ki) * 4);
    fill_bf16(qi.data(), size_t(256 * Hi * Di), 41);
    {
      std::vector<float> h(size_t(256 * Hi));
      std::mt19937 r(42);
      for (auto& x : h) x = float(r() % 1000) / 500.0f - 0.5f;
      KCUDA_CHECK(cudaMemcpy(hw.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    for (IndexKeyFormat kf : {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4}) {
      cuda::PagedMlaCache c;
      c.key_format = kf, c.block_size = P, c.C = 512, c.R = 64, c.Di = Di;
      const int64_t tb = c.key_token_bytes();
      cuda::DeviceBuffer arena(size_t(pool_tokens * tb)), rows(size_t(65536 * Di) * 2), slots(65536 * 8);
      fill_bf16(rows.data(), size_t(65536 * Di), 43);
      {
        std::vector<int64_t> hs(65536);
        c.keys = static_cast<uint8_t*>(arena.data());
        for (int64_t off = 0; off < pool_tokens; off += 65536) {
          std::iota(hs.begin(), hs.end(), off);
          KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), hs.size() * 8, cudaMemcpyHostToDevice));
          cuda::paged_write_keys(c, static_cast<uint16_t*>(rows.data()), Di, static_cast<int64_t*>(slots.data()), 65536,
                                 nullptr);
        }
        KCUDA_CHECK(cudaDeviceSynchronize());
      }
      header(fmt::format("Paged indexer select (exact-order FP32 scores, 32 heads × 128, + radix top-2048), {} keys "
                         "({} B/token), all B requests in one launch pair",
                         kf == IndexKeyFormat::fp8 ? "FP8" : "MXFP4", tb));
      for (int64_t B : batches) {
        const double us = tm.median_us([&] {
          cuda::paged_write_keys(c, static_cast<uint16_t*>(rows.data()), Di, static_cast<int64_t*>(slots.data()), B,
                                 nullptr);
        }, 3, 20);
        row("paged_write_keys", fmt::format("B={}", B), us, double(B) * (Di * 2 + tb + 8), 0, "—");
      }
      for (int64_t S : ctxs_all) {
        for (int64_t B : batches) {
          if (B * S > (int64_t(8) << 20)) continue;  // score scratch and time: ≤ 8M scored keys per call
          const auto tables = tables_for(B, S, pool_tokens / P);
          std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(S));
          cuda::DeviceBuffer dt(tables.size() * 4), dl(lens.size() * 4), scores(size_t(B * S) * 4);
          KCUDA_CHECK(cudaMemcpy(dt.data(), tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
          KCUDA_CHECK(cudaMemcpy(dl.data(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
          c.block_tables = static_cast<int32_t*>(dt.data()), c.bt_stride = (S + P - 1) / P;
          const double us = tm.median_us([&] {
            cuda::indexer_select_paged(static_cast<uint16_t*>(qi.data()), static_cast<float*>(hw.data()), c,
                                       static_cast<int32_t*>(dl.data()), nullptr, B, S, Hi, Ki,
                                       static_cast<float*>(scores.data()), S, static_cast<int32_t*>(sel.data()), nullptr);
          }, 2, quick ? 5 : 10);
          const double bytes = double(B) * S * (tb + 4 + 5 * 4);  // keys, score write, 5 score passes of top-k
          const double flops = double(B) * S * Hi * (2.0 * Di + 3);
          row("indexer_select_paged", fmt::format("B={} S={}", B, S), us, bytes, flops,
              S == 32768 ? "(DSA module 168/201/346/762)" : "—");
        }
      }
    }
  }

  // ---- chunked KDA prefill ---------------------------------------------------------------------------------
  if (want("kda_chunked")) {
    header("KDA prefill core (chunked WY/UT scan, chunk 64), H=12, Dk=128, FP32 state in the pool; B requests of "
           "L tokens in one launch (and the recurrent kernel at B=1 for comparison)");
    const int64_t H = 12, Dk = 128, HD = H * Dk;
    for (int64_t L : ctxs_all) {
      for (int64_t B : batches) {
        if (B * L > (int64_t(1) << 20)) continue;  // ≤ 1M tokens (32 GB of f32 q/k/v/g/o)
        const int64_t T = B * L;
        cuda::DeviceBuffer io(size_t(5 * T * HD) * 4), beta(size_t(T * H) * 4), cu(size_t(B + 1) * 4),
            slots(size_t(B) * 4), pool(size_t(B * H * Dk * Dk) * 4);
        {
          // q, k unit-norm-ish (|x| ≤ 0.09, 128 dims), v ∈ ±1, g ∈ (−0.1, 0), β = 0.5; one 4 MiB random
          // pattern per tensor, repeated (host-side generation of GBs would dominate the run).
          const int64_t pat = int64_t(1) << 20;
          std::vector<float> h(static_cast<size_t>(pat));
          std::mt19937 r(51);
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          for (int a = 0; a < 4; ++a) {
            for (auto& x : h) x = a == 3 ? -0.05f * (1 + u(r)) : a == 2 ? u(r) : 0.09f * u(r);
            float* dst = static_cast<float*>(io.data()) + a * T * HD;
            for (int64_t off = 0; off < T * HD; off += pat)
              KCUDA_CHECK(cudaMemcpy(dst + off, h.data(), size_t(std::min(pat, T * HD - off)) * 4, cudaMemcpyHostToDevice));
          }
          std::vector<float> hb(size_t(T * H), 0.5f);
          KCUDA_CHECK(cudaMemcpy(beta.data(), hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
          std::vector<int32_t> hc(size_t(B + 1)), hs(static_cast<size_t>(B));
          for (int64_t b = 0; b <= B; ++b) hc[size_t(b)] = int32_t(b * L);
          std::iota(hs.begin(), hs.end(), 0);
          KCUDA_CHECK(cudaMemcpy(cu.data(), hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
          KCUDA_CHECK(cudaMemcpy(slots.data(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
          KCUDA_CHECK(cudaMemset(pool.data(), 0, pool.size()));
        }
        float* f = static_cast<float*>(io.data());
        auto run = [&](bool chunked) {
          using Scan = void (*)(const float*, const float*, const float*, const float*, int64_t, const float*, int64_t,
                                const int32_t*, const int32_t*, float*, float*, int64_t, int64_t, int64_t, cudaStream_t);
          const Scan fn = chunked ? Scan(cuda::kda_chunked) : Scan(cuda::kda_recurrent);
          fn(f, f + T * HD, f + 2 * T * HD, f + 3 * T * HD, HD, static_cast<float*>(beta.data()), H,
             static_cast<int32_t*>(cu.data()), static_cast<int32_t*>(slots.data()), static_cast<float*>(pool.data()),
             f + 4 * T * HD, B, H, Dk, nullptr);
        };
        const double bytes = 5.0 * T * HD * 4 + T * H * 4 + 2.0 * B * H * Dk * Dk * 4;
        // Chunked-form work per 64-token chunk and head: A and QK (2·C²/2·Dk each), the S₀ products (2·C·Dk²),
        // the state update (C·Dk²), the solve and the intra-chunk output (C²·Dk each), counted 2 per FMA.
        const double chunks = double(B) * H * double((L + 63) / 64);
        const double flops = chunks * 2.0 * (64.0 * 64 * Dk + 3.0 * 64 * Dk * Dk + 64.0 * 64 * Dk);
        const double us = tm.median_us([&] { run(true); }, 1, quick ? 3 : 5);
        row("kda_chunked", fmt::format("B={} L={}", B, L), us, bytes, flops,
            B == 1 && L == 32768 ? "≈2300 (12 heads, FlashKDA/FLA)" : "—");
        if (B == 1) {
          const double rus = tm.median_us([&] { run(false); }, 1, 3);
          row("kda_recurrent (prefill)", fmt::format("B={} L={}", B, L), rus, bytes, double(T) * H * Dk * Dk * 8,
              L == 32768 ? "≈2300" : "—");
        }
      }
    }
  }

  // ---- vision tower (MODEL.md §6, issue #21): one 1024×1024 image at the real dims ---------------------------
  if (want("vision")) {
    header("MoonViT-V2 encoder, real dims (27 blocks, 1024 wide, 12 heads × 128), random weights");
    VisionConfig vc;
    vc.present = true;
    vc.hidden_size = 1024, vc.num_heads = 12, vc.qkv_hidden_size = 1536, vc.intermediate_size = 4096;
    vc.num_layers = 27, vc.text_hidden_size = 7168, vc.init_pos_emb_height = 64, vc.init_pos_emb_width = 64;
    std::vector<cuda::DeviceBuffer> keep;
    uint64_t seed = 50;
    auto dev = [&](int64_t n) {
      keep.emplace_back(size_t(n) * 2);
      fill_bf16(keep.back().data(), size_t(n), seed++);
      return static_cast<const uint16_t*>(keep.back().data());
    };
    const int64_t Dv = vc.hidden_size, Q = vc.qkv_hidden_size, F = vc.intermediate_size, M = vc.merged_width();
    vision::VisionDeviceWeights w;
    w.patch_embed = dev(Dv * 588);
    w.pos_emb = dev(64 * 64 * Dv);
    w.pos_host.resize(size_t(64 * 64 * Dv));
    KCUDA_CHECK(cudaMemcpy(w.pos_host.data(), w.pos_emb, w.pos_host.size() * 2, cudaMemcpyDeviceToHost));
    for (int b = 0; b < vc.num_layers; ++b)
      w.blocks.push_back({dev(Dv), dev(Dv), dev(3 * Q * Dv), dev(Dv * Q), dev(F * Dv), dev(Dv * F)});
    w.final_norm = dev(Dv);
    w.proj0 = dev(M * M);
    w.proj2 = dev(int64_t(vc.text_hidden_size) * M);
    w.post_norm = dev(vc.text_hidden_size);
    vision::VisionCuda enc(vc, std::move(w));
    for (int n_img : {1, 4}) {
      // 1024×1024 → 74×74 patches of 14 px (1036 px after padding to a multiple of 28): 5476 patches, 1369 tokens
      std::vector<std::shared_ptr<ImageInput>> ims;
      std::vector<const ImageInput*> ptrs;
      for (int i = 0; i < n_img; ++i) {
        auto im = std::make_shared<ImageInput>();
        im->grid_h = im->grid_w = 74;
        im->patches.assign(size_t(74 * 74 * 588), 0.0f);
        for (size_t k = 0; k < im->patches.size(); ++k) im->patches[k] = float((k * 2654435761u + i) % 2001) / 1000.0f - 1.0f;
        ims.push_back(im);
        ptrs.push_back(im.get());
      }
      const auto h0 = std::chrono::steady_clock::now();
      const int64_t tokens = enc.prepare(ptrs, nullptr);
      const double prep_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
      cuda::DeviceBuffer out(size_t(tokens * vc.text_hidden_size) * 2);
      const double us = tm.median_us([&] { enc.run(static_cast<uint16_t*>(out.data()), nullptr); }, 1, quick ? 3 : 5);
      const double T = 5476.0 * n_img, N = 5476.0;
      const double gemm = 2.0 * T * vc.num_layers * (double(Dv) * 3 * Q + double(Q) * Dv + 2.0 * Dv * F) +
                          2.0 * T * 588 * Dv + 2.0 * (T / 4) * (double(M) * M + double(M) * vc.text_hidden_size);
      const double attn = 4.0 * n_img * N * N * Q * vc.num_layers;  // QKᵀ and PV
      const double bytes = 2.0 * (27.0 * (3 * Q * Dv + Dv * Q + 2 * Dv * F) + double(M) * M + double(M) * 7168);
      row("vision encode (GPU part)", fmt::format("{} × 74x74 patches", n_img), us, bytes, gemm + attn,
          "—");
      fmt::print("host prepare (checks, bf16 patches, uploads): {:.0f} µs; attention {:.2f} of {:.2f} TFLOP\n",
                 prep_us, attn / 1e12, (gemm + attn) / 1e12);
      fmt::print("PERF vision_encode_1024px_x{}_us {:.0f}\n", n_img, us);
      KCUDA_CHECK(cudaDeviceSynchronize());
      // attention alone, for the share of the step
      cuda::DeviceBuffer qkv(size_t(T * 3 * Q) * 2), o(size_t(T * Q) * 2), r0(size_t(n_img + 1) * 4);
      fill_bf16(qkv.data(), size_t(T * 3 * Q), 7);
      std::vector<int32_t> hr;
      for (int i = 0; i <= n_img; ++i) hr.push_back(5476 * i);
      KCUDA_CHECK(cudaMemcpy(r0.data(), hr.data(), hr.size() * 4, cudaMemcpyHostToDevice));
      const double aus = tm.median_us([&] {
        cuda::vision_attention(static_cast<uint16_t*>(qkv.data()), 3 * Q, Q, static_cast<int32_t*>(r0.data()), n_img,
                               5476, 12, 128, static_cast<uint16_t*>(o.data()), Q, nullptr);
      }, 1, quick ? 3 : 5);
      row("vision_attention (one block)", fmt::format("{} × 5476 rows, 12 × 128", n_img), aus,
          2.0 * T * 4 * Q, attn / vc.num_layers, "—");
    }
  }

  if (!model_dir.empty() && want("model")) decode_step(model_dir, fp8, perf);
  return 0;
}
