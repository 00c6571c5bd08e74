// EngineHost: builds and owns everything an engine runs on — config, checkpoint, bound weights, the
// device (CPU, or the GPU model and executor), the memory budget, the end-of-sequence ids — and the
// runtime::Engine itself. Both `kestrel serve` and `kestrel generate` get their engine here, from
// one EngineOptions (filled by the shared CLI flags, cli/engine_flags.h), so device choice and the
// budget rules live in one place:
//   - --device cpu: the CPU executor; --memory-budget SIZE, or --gpu-memory-utilization F = F ×
//     physical RAM − the checkpoint's bytes, or 1 GiB;
//   - --device cuda: the weights are uploaded (model::CudaModel) and the engine runs on the GPU
//     executor (executor_cuda.h); --gpu-memory-utilization F = F × device memory − what is in use
//     after the upload − a 2 GiB activation reserve (runtime::cuda_cache_budget);
//   - --tensor-parallel-size N (--enable-expert-parallel, --decode-context-parallel-size N) on the CPU: N rank threads, each over its
//     own shard of the mapped checkpoint (executor_tp.h); a layout the model cannot split fails the
//     load with every reason (loader/shard.h). On CUDA (TP and EP; DCP not yet): N rank threads, one GPU each, NCCL
//     (executor_cuda_tp.h; --debug-tp-on-one-gpu puts them all on GPU 0; --enable-custom-all-reduce sends
//     decode-sized all-reduces through the one-shot kernel, parallel/peer_allreduce.h). The budget (--memory-budget,
//     or from --gpu-memory-utilization) is one rank's: the memory plan counts one rank's caches;
//   - under `mpirun -np N` with --device cpu --tensor-parallel-size N: process r is rank r; call
//     run_mpi_rank() first — ranks > 0 execute rank 0's steps there and return true, rank 0 goes on with an
//     EngineHost whose executor broadcasts each StepPlan (runtime/executor_mpi.h);
//   - fake: config.json only, no weights; a FakeExecutor (fake_executor.h) draws the tokens.
// Loading runs on a thread of the host's own, so a server can listen (and answer /health with 503)
// meanwhile; wait_loaded() blocks for callers that need the engine now. The host is the front
// ends' engine (request/engine.h): it is not ready while loading and forwards everything to the
// runtime engine once loaded, without translating anything.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "request/engine.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"
#include "runtime/spec_config.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::parallel {
class Comm;
}

namespace kestrel::runtime {

enum class Device : uint8_t { cpu, cuda };

struct EngineOptions {
  std::string model_dir;
  Device device = Device::cpu;
  std::optional<int64_t> memory_budget;  // bytes for KV pages + KDA slots; absent: see the header
  double gpu_memory_utilization = 0.0;   // (0, 1] when given
  bool cuda_graphs = true;               // --device cuda: decode steps through CUDA graphs
  int cpu_threads = 0;                   // threads of the CPU ops (kernels/cpu/thread_pool.h); 0: every core
  std::string quantization = "bf16";     // --device cuda: dense projection weights bf16 | ptpc-fp8
  int tensor_parallel_size = 1;          // --tensor-parallel-size: ranks (CPU: threads)
  bool expert_parallel = false;          // --enable-expert-parallel: whole experts per rank
  int decode_context_parallel_size = 1;  // --decode-context-parallel-size: 1 or the TP size (CPU twin)
  bool debug_tp_on_one_gpu = false;      // --debug-tp-on-one-gpu: CUDA TP ranks all on GPU 0 (tests)
  bool custom_all_reduce = false;        // --enable-custom-all-reduce: CUDA TP, one-shot all-reduce <= 1 MB
  // Under mpirun (run_mpi_rank, rank 0 only): the world communicator; the engine's executor then hosts
  // rank 0 of a TP group whose other ranks are the other processes (executor_mpi.h).
  std::shared_ptr<parallel::Comm> mpi_world;
  // Formats, batching, prefix cache, max_model_len, max_queue; the host fills in the budget, the
  // end-of-sequence ids and the executor.
  EngineConfig engine;
  // Optional, must outlive the host: its end-of-turn specials (<|end_of_msg|>, [EOS], [EOT]) join the
  // config's eos_token_id as end-of-sequence ids.
  const tok::Tokenizer* tokenizer = nullptr;
  bool fake = false;                     // no weights: random (or scripted) tokens
  FakeExecutorOptions fake_executor;
  std::chrono::milliseconds fake_load_delay{0};  // lets tests see /health answer 503 while "loading"
  // --speculative-config: the draft is loaded, checked against the target and used by the CPU engine
  // (docs/speculative.md); --device cuda and tensor parallelism refuse it for now.
  std::optional<SpeculativeConfig> speculative;
};

class EngineHost final : public kestrel::Engine {
 public:
  // Starts loading on a thread of its own.
  explicit EngineHost(EngineOptions options);
  ~EngineHost() override;

  // Blocks until loaded or failed; true when loaded. On failure load_error() says why.
  bool wait_loaded() const;
  std::string load_error() const;
  // After a successful load (kestrel::Error otherwise).
  runtime::Engine& engine() const;
  const ModelConfig& model_config() const;

  bool ready() const override;
  std::string failure() const override;  // load_error(), or the loaded engine's failed step
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  Submission submit(Request r, TokenSink sink) override;
  bool cancel(RequestId id) override;
  EngineStats stats() const override;
  IntegrityReport check_integrity() const override;  // kestrel::Error while not loaded
  void shutdown() override;  // waits for a load in progress, then shuts the engine down

 private:
  struct Loaded;
  void check_options() const;  // option errors, at once (before the load)
  void load();
  void load_speculative(Loaded& m, EngineConfig& ec) const;
  runtime::Engine* get() const;  // null while loading, after a failed load or after shutdown

  EngineOptions opt_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool loaded_ = false;
  std::string load_error_;
  std::unique_ptr<Loaded> loaded_model_;  // set once, under mu_
  std::mutex shutdown_mu_;
  std::thread loader_;
};

// Bytes of the checkpoint's .safetensors files (the weights' share of memory).
int64_t checkpoint_bytes(const std::string& dir);

// Under `mpirun -np N kestrel generate|serve --device cpu --tensor-parallel-size N`: process r is TP rank r.
// Rank 0: sets o.mpi_world and returns false (go on: the EngineHost hosts rank 0). Ranks > 0: load their
// shard, execute every step rank 0 broadcasts until it stops, and return true (the command then exits).
// Outside mpirun, on the GPU, with TP1 or under `mpirun -np 1`: returns false and changes nothing. Throws
// when the world size differs from the TP size.
bool run_mpi_rank(EngineOptions& o);

}  // namespace kestrel::runtime
