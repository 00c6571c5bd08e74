// EngineFlags: see engine_flags.h.
#include "cli/engine_flags.h"

#include <algorithm>
#include <filesystem>

#include "cache/layout.h"
#include "core/cache_format.h"
#include "core/check.h"

namespace kestrel::cli {

int64_t parse_bytes(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    fail("--memory-budget: '{}' is not a size", s);
  }
  std::string unit = s.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() == 2 && unit[1] == 'i') unit.pop_back();
  double mul = 1;
  if (unit == "K" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "m") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") mul = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) fail("--memory-budget: unknown unit in '{}' (use K, M or G)", s);
  if (!(v > 0)) fail("--memory-budget must be positive, got '{}'", s);
  return int64_t(v * mul);
}

std::string default_model_dir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const std::filesystem::path bin = exe.parent_path();
  for (const std::filesystem::path& p : {bin / "models" / "k3-tiny", bin / "k3-tiny",
                                         bin / ".." / "share" / "kestrel" / "models" / "k3-tiny",
                                         bin / ".." / ".." / ".." / "models" / "k3-tiny"})
    if (std::filesystem::is_regular_file(p / "config.json", ec)) return std::filesystem::weakly_canonical(p, ec).string();
  return {};
}

int long_prefill_default(bool cuda, int max_num_batched_tokens) {
  // What counts as long, and the largest long chunk; the engine shrinks the chunk further to its
  // step-time target (EngineConfig::prefill_step_target_s).
  const int want = cuda ? 2048 : 256;
  return std::max(1, std::min(want, max_num_batched_tokens / 2));
}

void EngineFlags::resolve_model() {
  if (!model.empty()) return;
  model = default_model_dir();
  if (model.empty())
    fail("no --model given, and the embedded k3-tiny was not found next to the binary (models/k3-tiny, "
         "../share/kestrel/models/k3-tiny, or the checkout it was built in); pass --model DIR");
}

void EngineFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--model", model, "checkpoint directory (tokenizer files included; default: the embedded k3-tiny)")
      ->each([this](const std::string&) { model_given = true; });
  cmd.add_option("--device", device, "cpu or cuda (the engine on the GPU executor)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd.add_flag("--no-cuda-graphs", no_cuda_graphs, "--device cuda: run decode steps eagerly");
  cmd.add_option("--quantization", quantization, "--device cuda: dense projection weights bf16 | ptpc-fp8 (online "
                                                 "FP8, per-token x per-channel scales)")
      ->check(CLI::IsMember({"bf16", "ptpc-fp8"}));
  auto* mb = cmd.add_option("--memory-budget", memory_budget, "bytes for KV pages + KDA state slots (e.g. 512M, 2G; default 1G)");
  auto* gu = cmd.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                            "fraction of memory for weights + caches (CPU: of physical RAM)");
  mb->excludes(gu);
  cmd.add_option("--kv-cache-dtype", kv_cache_dtype, "MLA latent cache: bf16 | fp8");
  cmd.add_option("--index-cache-dtype", index_cache_dtype, "indexer key cache: bf16 | fp8 | mxfp4");
  cmd.add_option("--kda-state-dtype", kda_state_dtype, "KDA recurrent state in the state pool: f32 | f16 (half the bytes)");
  cmd.add_option("--block-size", block_size, "KV page size in tokens (default: the engine's, 128)")->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--max-num-seqs", max_num_seqs, "requests generating at once (serve: 16; generate: the prompts, at most 16)")
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--max-num-batched-tokens", max_num_batched_tokens, "token budget of one engine step")
      ->check(CLI::Range(1, 1 << 24));
  cmd.add_option("--max-model-len", max_model_len, "context length: prompt + completion (default: the model's, "
                                                   "capped by the memory plan)")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 40));
  cmd.add_flag("--no-prefix-cache", no_prefix_cache, "disable prefix caching");
  cmd.add_option("--threads", threads, "threads of the CPU engine's ops, for the whole step (default: every core)")
      ->check(CLI::Range(0, 1024));
  cmd.add_option("--structured-mask-threads", mask_threads,
                 "threads computing structured outputs' token masks while the forward runs (default: a quarter of "
                 "the cores, 1 to 8)")
      ->check(CLI::Range(0, 256));
  cmd.add_option("--tensor-parallel-size", tensor_parallel_size,
                 "ranks the model is split over (heads, projections, experts; docs/parallel.md): threads of this "
                 "process; --device cuda: one GPU each, NCCL")
      ->check(CLI::Range(1, 1024));
  cmd.add_flag("--enable-expert-parallel", enable_expert_parallel,
               "with --tensor-parallel-size N: whole experts per rank instead of every expert split N ways");
  cmd.add_option("--decode-context-parallel-size", decode_context_parallel_size,
                 "spread each request's MLA latent and index-key cache along tokens over this many TP ranks (1 or "
                 "the TP size)")
      ->check(CLI::Range(1, 1024));
  cmd.add_flag("--debug-tp-on-one-gpu", debug_tp_on_one_gpu,
               "--device cuda --tensor-parallel-size N: every rank on GPU 0 through a same-device communicator "
               "(slow; for testing the parallel code on one GPU)");
  cmd.add_flag("--enable-custom-all-reduce", enable_custom_all_reduce,
               "--device cuda --tensor-parallel-size N: all-reduces of at most 1 MB (decode) through a one-shot "
               "kernel over peer-accessible GPU buffers instead of NCCL (docs/parallel.md §2)");
  cmd.add_option("--long-prefill-token-threshold", long_prefill_token_threshold,
                 "longest prefill chunk per step; longer prompts are 'long' (0: no cap; default: CPU 256, GPU 2048, "
                 "at most half of --max-num-batched-tokens)")
      ->check(CLI::Range(0, 1 << 24));
  cmd.add_option("--max-num-partial-prefills", max_num_partial_prefills, "requests prefilling at once")
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--max-long-partial-prefills", max_long_partial_prefills,
                 "long prompts prefilling at once (shorter ones pass a waiting long one)")
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_flag("--async-scheduling", async_scheduling,
               "run-ahead: in pure decode of plain requests (no logprobs, penalties, bias, structured output), "
               "launch each step before the previous one's tokens are back, so the device never waits for the host "
               "between steps (docs/serving.md). Same tokens either way; on the CPU, whose forward is synchronous, "
               "nothing overlaps. Executors that cannot run ahead (tensor parallel, fake) ignore it with a note");
  cmd.add_option("--speculative-config", speculative_config,
                 "DSpark speculative decoding, vLLM's JSON: {\"method\":\"dspark\",\"model\":\"DIR\","
                 "\"num_speculative_tokens\":7,\"draft_sample_method\":\"probabilistic\",\"rejection_sample_method\":\"block\"}");
}

runtime::EngineOptions EngineFlags::options(int default_max_num_seqs) const {
  runtime::EngineOptions o;
  o.model_dir = model;
  if (!speculative_config.empty()) o.speculative = runtime::parse_speculative_config(speculative_config);
  o.device = device == "cuda" ? runtime::Device::cuda : runtime::Device::cpu;
  if (!memory_budget.empty()) o.memory_budget = parse_bytes(memory_budget);
  o.gpu_memory_utilization = gpu_memory_utilization;
  o.cuda_graphs = !no_cuda_graphs;
  o.cpu_threads = threads;
  o.quantization = quantization;
  o.tensor_parallel_size = tensor_parallel_size;
  o.expert_parallel = enable_expert_parallel;
  o.decode_context_parallel_size = decode_context_parallel_size;
  o.debug_tp_on_one_gpu = debug_tp_on_one_gpu;
  o.custom_all_reduce = enable_custom_all_reduce;
  runtime::EngineConfig& ec = o.engine;
  ec.formats.latent = parse_latent_format(kv_cache_dtype);
  ec.formats.index_keys = parse_index_key_format(index_cache_dtype);
  ec.formats.kda_state = parse_kda_state_dtype(kda_state_dtype);
  if (block_size > 0) ec.formats.block_size = block_size;
  ec.max_running = max_num_seqs > 0 ? max_num_seqs : default_max_num_seqs;
  ec.max_num_batched_tokens = max_num_batched_tokens;
  ec.mask_threads = mask_threads;
  ec.max_model_len = max_model_len;
  ec.enable_prefix_cache = !no_prefix_cache;
  ec.long_prefill_token_threshold = long_prefill_token_threshold >= 0
                                        ? long_prefill_token_threshold
                                        : long_prefill_default(o.device == runtime::Device::cuda, max_num_batched_tokens);
  // A step with a long prefill in it lasts about this long (CPU: a short request's first token within
  // 3 s is two such steps and its own prompt; GPU: within 200 ms).
  ec.prefill_step_target_s = o.device == runtime::Device::cuda ? 0.05 : 0.75;
  ec.max_num_partial_prefills = max_num_partial_prefills;
  ec.max_long_partial_prefills = max_long_partial_prefills;
  ec.async_scheduling = async_scheduling;
  return o;
}

}  // namespace kestrel::cli
