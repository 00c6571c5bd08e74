// EngineHost: see engine_host.h.
#include "runtime/engine_host.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "core/check.h"
#include "kernels/cpu/thread_pool.h"
#include "loader/config.h"
#include "loader/dspark.h"
#include "loader/safetensors.h"
#include "loader/shard.h"
#include "loader/weights.h"
#include "parallel/mpi_comm.h"
#include "runtime/executor_mpi.h"
#include "runtime/executor_tp.h"
#include "tokenizer/parser.h"
#ifdef KESTREL_WITH_CUDA
#include "model/cuda/cuda_model.h"
#include "runtime/executor_cuda.h"
#include "runtime/executor_cuda_tp.h"
#include "vision/cuda/vision_cuda.h"
#endif

namespace kestrel::runtime {

// Declared in this order so the engine (which refers to cfg, w and the device) goes first.
struct EngineHost::Loaded {
  std::shared_ptr<MpiLead> lead;  // under mpirun: rank 0's side of the world (outlives the engine)
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
  std::shared_ptr<void> device;  // the GPU model behind --device cuda
  // --speculative-config: the draft's config, checkpoint, weights and the bound draft (Draft points at them).
  DraftConfig draft_cfg;
  std::unique_ptr<Checkpoint> draft_ckpt;
  DraftWeights draft_w;
  std::unique_ptr<model::Draft> draft;
  std::unique_ptr<runtime::Engine> engine;
};

int64_t checkpoint_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") n += int64_t(e.file_size());
  return n;
}

namespace {

void check_utilization(double f) {
  if (!(f > 0.0 && f <= 1.0)) fail("--gpu-memory-utilization must be in (0, 1], got {}", f);
}

// --gpu-memory-utilization on the CPU: the fraction of physical RAM, less the weights.
int64_t cpu_cache_budget(double f, const std::string& model_dir) {
  check_utilization(f);
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  const int64_t budget = int64_t(f * ram) - checkpoint_bytes(model_dir);
  if (budget <= 0) fail("--gpu-memory-utilization {} leaves no memory after the weights", f);
  return budget;
}

// --device cuda: uploads the weights and sets the GPU executor and, for a utilization, the budget
// from the device's memory. Returns the GPU model (and vision encoder), to live as long as the engine.
std::shared_ptr<void> setup_cuda(const EngineOptions& o, const ModelConfig& c, const Checkpoint& ckpt,
                                 const ModelWeights& w, EngineConfig& ec) {
#ifdef KESTREL_WITH_CUDA
  if (o.tensor_parallel_size > 1) {
    // N ranks, one GPU each (or all on one with the debug flag); each binds and uploads its own shard.
    ParallelLayout p;
    p.tp = o.tensor_parallel_size;
    p.expert_parallel = o.expert_parallel;
    CudaTpOptions to;
    to.one_device = o.debug_tp_on_one_gpu;
    to.custom_all_reduce = o.custom_all_reduce;
    to.model.quant = model::parse_weight_quant(o.quantization);
    auto g = std::make_shared<CudaTpGroup>(c, ckpt, p, to);
    ec.tp_size = p.tp;
    if (o.gpu_memory_utilization > 0.0) {
      check_utilization(o.gpu_memory_utilization);
      ec.memory_budget = g->cache_budget(o.gpu_memory_utilization, int64_t(2) << 30);
    }
    CudaTpGroup* gp = g.get();
    ec.make_executor = [gp](const CacheFormats& f, const cache::CacheConfig& cc) {
      return std::unique_ptr<StepExecutor>(std::make_unique<CudaTpExecutor>(*gp, f, cc));
    };
    return g;
  }
  // The text model and, for a checkpoint with a vision tower, the GPU encoder with its weights (uploaded
  // before the budget below, so they count as in use). Members go in reverse: encoder, its weights, model.
  struct GpuDevice {
    std::unique_ptr<model::CudaModel> model;
    std::vector<cuda::DeviceBuffer> vision_weights;
    std::unique_ptr<vision::VisionCuda> vision;
  };
  auto d = std::make_shared<GpuDevice>();
  model::CudaModelOptions mo;
  mo.quant = model::parse_weight_quant(o.quantization);
  d->model = std::make_unique<model::CudaModel>(c, w, mo);
  if (c.vision.present && w.has_vision)
    d->vision = std::make_unique<vision::VisionCuda>(c.vision, vision::VisionCuda::upload(w.vision, d->vision_weights));
  // Activations of one step (max_num_batched_tokens rows through the widest layer), the vision encoder's
  // scratch (≤ kMaxVisionPatches patches a call, about 0.55 GB at the real vision dims) and cuBLASLt's
  // workspace: a fixed 2 GiB covers the mini and nano shapes with room to spare.
  if (o.gpu_memory_utilization > 0.0) {
    check_utilization(o.gpu_memory_utilization);
    ec.memory_budget = cuda_cache_budget(o.gpu_memory_utilization, int64_t(2) << 30);
  }
  const ModelConfig* cp = &c;
  GpuDevice* dp = d.get();
  // --speculative-config (load_speculative ran before): the executor drafts and verifies (executor_cuda.h);
  // KESTREL_DRAFT_ON_GPU=1 runs the draft on the GPU too (model/cuda/dspark.h; not yet measured on a GPU,
  // so opt-in).
  const char* dg = std::getenv("KESTREL_DRAFT_ON_GPU");
  const bool draft_gpu = dg && std::string(dg) == "1";
  ec.make_executor = [dp, cp, graphs = o.cuda_graphs, spec = ec.speculative, draft_gpu](const CacheFormats& f,
                                                                                         const cache::CacheConfig& cc) {
    CudaExecutorOptions eo;
    eo.cuda_graphs = graphs;
    eo.vision = dp->vision.get();
    eo.speculative = spec;
    eo.draft_on_gpu = draft_gpu;
    return std::unique_ptr<StepExecutor>(std::make_unique<CudaExecutor>(*dp->model, *cp, f, cc, eo));
  };
  ec.executor_speculates = ec.speculative.has_value();
  return d;
#else
  (void)o, (void)c, (void)ckpt, (void)w, (void)ec;
  fail("--device cuda: this kestrel was built without CUDA");
#endif
}

}  // namespace

EngineHost::EngineHost(EngineOptions options) : opt_(std::move(options)) {
  try {
    check_options();
  } catch (...) {
    // Under mpirun the other ranks already wait for rank 0's first message: release them.
    if (opt_.mpi_world) {
      try {
        MpiLead(*opt_.mpi_world).stop();
      } catch (...) {
      }
    }
    throw;
  }
  loader_ = std::thread([this] { load(); });
}

EngineHost::~EngineHost() { shutdown(); }

void EngineHost::check_options() const {
  // Option errors (a bad utilization) surface at once rather than as a failed load.
  if (opt_.memory_budget && *opt_.memory_budget <= 0) fail("--memory-budget must be positive");
  if (opt_.gpu_memory_utilization != 0.0) check_utilization(opt_.gpu_memory_utilization);
  if (opt_.quantization != "bf16" && (opt_.device != Device::cuda || opt_.fake))
    fail("--quantization {} needs --device cuda", opt_.quantization);
  if (opt_.tensor_parallel_size < 1) fail("--tensor-parallel-size must be >= 1, got {}", opt_.tensor_parallel_size);
  if (opt_.decode_context_parallel_size != 1 && opt_.decode_context_parallel_size != opt_.tensor_parallel_size)
    fail("--decode-context-parallel-size {} must be 1 or the --tensor-parallel-size ({}): the CPU twin spreads a "
         "request's MLA cache over the whole TP group",
         opt_.decode_context_parallel_size, opt_.tensor_parallel_size);
  if (opt_.expert_parallel && opt_.tensor_parallel_size == 1)
    fail("--enable-expert-parallel needs --tensor-parallel-size > 1 (experts are spread over the TP ranks)");
  if (opt_.tensor_parallel_size > 1 && opt_.device == Device::cuda && opt_.decode_context_parallel_size > 1)
    fail("--tensor-parallel-size {} with --device cuda: --decode-context-parallel-size > 1 is not built on the GPU "
         "engine yet (--device cpu runs it on the tensor-parallel CPU twin)",
         opt_.tensor_parallel_size);
  if (opt_.debug_tp_on_one_gpu && opt_.device != Device::cuda)
    fail("--debug-tp-on-one-gpu needs --device cuda");
  // The one-shot kernel replaces the GPU ranks' all-reduces; with one rank there is none, and the CPU twin's
  // host comm already sums in the kernel's order: asking for it there is a mistake, said at once.
  if (opt_.custom_all_reduce && (opt_.device != Device::cuda || opt_.tensor_parallel_size < 2))
    fail("--enable-custom-all-reduce needs --device cuda and --tensor-parallel-size > 1 (it replaces the GPU ranks' "
         "decode-sized all-reduces)");
}


// --speculative-config: load and check the draft (config against the target, every tensor) and bind it to
// the target's embedding and lm_head. The CPU executor and the one-GPU executor speculate
// (runtime/spec_executor.h, executor_cuda.h; setup_cuda hands the GPU executor ec.speculative); the
// tensor-parallel executors do not yet, so those refuse it.
void EngineHost::load_speculative(Loaded& m, EngineConfig& ec) const {
  const SpeculativeConfig& sc = *opt_.speculative;
  if (opt_.tensor_parallel_size > 1)
    fail("--speculative-config: speculative decoding runs with one rank only so far (--device cpu or cuda; "
         "docs/speculative.md)");
  m.draft_cfg = load_draft_config(sc.model, m.cfg);
  if (sc.num_speculative_tokens > m.draft_cfg.block_size)
    fail("--speculative-config: num_speculative_tokens {} exceeds the draft's block size {}", sc.num_speculative_tokens,
         m.draft_cfg.block_size);
  m.draft_ckpt = std::make_unique<Checkpoint>(sc.model);
  m.draft_w = bind_draft_weights(m.draft_cfg, *m.draft_ckpt);
  m.draft = std::make_unique<model::Draft>(m.draft_cfg, m.draft_w, m.w);
  SpecServing s;
  s.draft = m.draft.get();
  s.num_speculative_tokens = sc.num_speculative_tokens > 0 ? sc.num_speculative_tokens : m.draft_cfg.block_size;
  s.rejection = sc.rejection;
  s.draft_greedy = sc.draft_greedy;
  s.draft_topk = sc.draft_topk;
  s.disable_by_batch_size = sc.disable_by_batch_size;
  ec.speculative = s;
}

void EngineHost::load() {
  std::string error;
  auto m = std::make_unique<Loaded>();
  // Under mpirun the other ranks wait for rank 0's messages from now on: a failed load must stop them.
  if (opt_.mpi_world) m->lead = std::make_shared<MpiLead>(*opt_.mpi_world);
  try {
    m->cfg = load_config(opt_.model_dir);
    EngineConfig ec = opt_.engine;
    if (opt_.memory_budget) ec.memory_budget = *opt_.memory_budget;
    ec.eos_token_ids.clear();
    if (m->cfg.text.eos_token_id >= 0) ec.eos_token_ids.push_back(m->cfg.text.eos_token_id);
    if (opt_.tokenizer)
      for (tok::TokenId id : tok::end_of_turn_ids(*opt_.tokenizer))
        if (int32_t(id) != m->cfg.text.eos_token_id) ec.eos_token_ids.push_back(int32_t(id));
    if (opt_.fake) {
      std::this_thread::sleep_for(opt_.fake_load_delay);
      ec.make_executor = fake_executor_factory(m->cfg.text.vocab_size, opt_.fake_executor);
      m->engine = std::make_unique<runtime::Engine>(m->cfg, ec);
    } else {
      cpu::set_num_threads(opt_.cpu_threads);  // the process-wide team of the CPU ops
      m->ckpt = std::make_unique<Checkpoint>(opt_.model_dir);
      m->w = bind_weights(m->cfg, *m->ckpt);
      if (opt_.speculative) load_speculative(*m, ec);
      if (opt_.device == Device::cuda) {
        m->device = setup_cuda(opt_, m->cfg, *m->ckpt, m->w, ec);
      } else if (!opt_.memory_budget && opt_.gpu_memory_utilization > 0.0) {
        ec.memory_budget = cpu_cache_budget(opt_.gpu_memory_utilization, opt_.model_dir);
      }
      if (opt_.device == Device::cpu && opt_.tensor_parallel_size > 1) {
        ParallelLayout p;
        p.tp = opt_.tensor_parallel_size;
        p.expert_parallel = opt_.expert_parallel;
        p.dcp = opt_.decode_context_parallel_size;
        if (ec.formats.block_size % p.dcp != 0)
          fail("--block-size {} must divide by --decode-context-parallel-size {}", ec.formats.block_size, p.dcp);
        // The plan counts one rank's caches (sched/memory_plan.h); the CPU twin's ranks share this
        // process's memory, so a budget from --gpu-memory-utilization is split between them.
        ec.tp_size = p.tp;
        ec.dcp_size = p.dcp;
        if (!opt_.memory_budget && opt_.gpu_memory_utilization > 0.0) ec.memory_budget /= p.tp;
        ec.make_executor = m->lead ? mpi_tp_executor_factory(m->cfg, *m->ckpt, p, m->lead, ExecutorOptions{ec.cpu_batched})
                                   : tp_executor_factory(m->cfg, *m->ckpt, p, ExecutorOptions{ec.cpu_batched});
      }
      m->engine = std::make_unique<runtime::Engine>(m->w, m->cfg, ec);
    }
  } catch (const std::exception& e) {
    error = e.what();
    if (m->lead) {
      try {
        m->lead->stop();  // no-op when the executor already said it
      } catch (...) {
      }
    }
  }
  std::lock_guard lk(mu_);
  loaded_ = true;
  if (error.empty())
    loaded_model_ = std::move(m);
  else
    load_error_ = error;
  cv_.notify_all();
}

bool EngineHost::wait_loaded() const {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return loaded_; });
  return loaded_model_ != nullptr;
}

std::string EngineHost::load_error() const {
  std::lock_guard lk(mu_);
  return load_error_;
}

runtime::Engine* EngineHost::get() const {
  std::lock_guard lk(mu_);
  return loaded_model_ ? loaded_model_->engine.get() : nullptr;
}

runtime::Engine& EngineHost::engine() const {
  runtime::Engine* e = get();
  if (!e) fail("the engine is not loaded{}", load_error().empty() ? "" : ": " + load_error());
  return *e;
}

const ModelConfig& EngineHost::model_config() const {
  engine();  // loaded, or a clear error
  return loaded_model_->cfg;
}

bool EngineHost::ready() const {
  runtime::Engine* e = get();
  return e && e->ready();
}

std::string EngineHost::failure() const {
  if (runtime::Engine* e = get()) return e->failure();
  return load_error();
}

int64_t EngineHost::max_model_len() const {
  runtime::Engine* e = get();
  return e ? e->max_model_len() : 0;
}

int64_t EngineHost::vocab_size() const {
  runtime::Engine* e = get();
  return e ? e->vocab_size() : 0;
}

Submission EngineHost::submit(Request r, TokenSink sink) {
  runtime::Engine* e = get();
  if (!e) return {};  // not_ready
  return e->submit(std::move(r), std::move(sink));
}

bool EngineHost::cancel(RequestId id) {
  runtime::Engine* e = get();
  return e && e->cancel(id);
}

EngineStats EngineHost::stats() const {
  runtime::Engine* e = get();
  return e ? e->stats() : EngineStats{};
}

IntegrityReport EngineHost::check_integrity() const {
  runtime::Engine* e = get();
  if (!e) fail("the engine is not loaded");
  return e->check_integrity();
}

bool run_mpi_rank(EngineOptions& o) {
  if (o.tensor_parallel_size <= 1 || o.device != Device::cpu || o.fake || !parallel::launched_by_mpi()) return false;
  std::shared_ptr<parallel::Comm> world(parallel::mpi_world());
  if (world->size() == 1) return false;  // `mpirun -np 1`: the in-process twin
  if (world->size() != o.tensor_parallel_size)
    fail("--tensor-parallel-size {} under mpirun needs exactly {} processes, one per rank (got {})",
         o.tensor_parallel_size, o.tensor_parallel_size, world->size());
  if (world->rank() == 0) {
    o.mpi_world = world;
    return false;
  }
  cpu::set_num_threads(o.cpu_threads);
  const ModelConfig cfg = load_config(o.model_dir);
  const Checkpoint ckpt(o.model_dir);
  ParallelLayout p;
  p.tp = o.tensor_parallel_size;
  p.expert_parallel = o.expert_parallel;
  p.dcp = o.decode_context_parallel_size;
  run_mpi_follower(cfg, ckpt, p, *world, ExecutorOptions{o.engine.cpu_batched});
  return true;
}

void EngineHost::shutdown() {
  std::lock_guard lk(shutdown_mu_);
  if (loader_.joinable()) loader_.join();
  if (runtime::Engine* e = get()) e->shutdown();
}

}  // namespace kestrel::runtime
