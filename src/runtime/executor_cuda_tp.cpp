// CudaTpGroup and CudaTpExecutor (see executor_cuda_tp.h).
#include "runtime/executor_cuda_tp.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/tp.h"
#include "parallel/device_comm.h"
#include "parallel/inproc_comm.h"
#include "parallel/nccl_comm.h"
#include "parallel/peer_allreduce.h"
#include "runtime/executor_cuda.h"

namespace kestrel::runtime {

std::vector<std::string> cuda_tp_problems(const ModelConfig& c, const ParallelLayout& p) {
  std::vector<std::string> out = layout_problems(c, p);
  if (!out.empty()) return out;
  const TextConfig& t = c.text;
  const int N = p.tp;
  if (p.dcp > 1)
    out.push_back("--decode-context-parallel-size > 1 is not built on the GPU engine yet (the CPU twin has it)");
  if (t.num_layers_of(MlpKind::moe) > 0) {
    if (!p.expert_parallel && (t.moe_intermediate_size / N) % 64 != 0)
      out.push_back(fmt::format("text_config.moe_intermediate_size = {} split {} ways gives {} columns per rank; the "
                                "GPU expert kernels need a multiple of 64",
                                t.moe_intermediate_size, N, t.moe_intermediate_size / N));
    if (t.num_shared_experts > 0 && (t.shared_intermediate() / N) % 8 != 0)
      out.push_back(fmt::format("shared experts width {} split {} ways is not a multiple of 8 (the GPU's gate/up "
                                "stack interleaves by 8 rows)",
                                t.shared_intermediate(), N));
  }
  if (t.num_layers_of(MlpKind::dense) > 0 && (t.intermediate_size / N) % 8 != 0)
    out.push_back(fmt::format("text_config.intermediate_size = {} split {} ways is not a multiple of 8 (the GPU's "
                              "gate/up stack interleaves by 8 rows)",
                              t.intermediate_size, N));
  return out;
}

// Declared in this order so the comm (which uses the model's stream) goes before the model.
struct CudaTpGroup::Rank {
  int device = 0;
  ModelConfig cfg;  // model::rank_config: this rank's head counts
  std::unique_ptr<model::CudaModel> model;
  std::unique_ptr<parallel::Comm> comm;
};

CudaTpGroup::CudaTpGroup(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                         const CudaTpOptions& o) {
  const std::vector<std::string> problems = cuda_tp_problems(c, layout);
  if (!problems.empty()) {
    std::string msg = fmt::format("cannot run this model as {} on the GPU ({} problem{}):", layout.name(),
                                  problems.size(), problems.size() == 1 ? "" : "s");
    for (const std::string& p : problems) msg += "\n  " + p;
    fail("{}", msg);
  }
  const int N = layout.tp;
  int current = 0, count = 0;
  KCUDA_CHECK(cudaGetDevice(&current));
  KCUDA_CHECK(cudaGetDeviceCount(&count));
  if (!o.one_device && count < N)
    fail("--tensor-parallel-size {} needs {} GPUs, one per rank; this machine has {} (--debug-tp-on-one-gpu runs "
         "every rank on one GPU, for tests)",
         N, N, count);
  for (int r = 0; r < N; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->device = o.one_device ? current : r;
    ranks_.push_back(std::move(rank));
  }
  // Upload, one rank after another (bounded host memory: one rank's packed column slices at a time), each
  // on a thread whose current device is the rank's (the model's allocator, stream and handles live there).
  for (int r = 0; r < N; ++r) {
    std::exception_ptr err;
    std::thread t([&, r] {
      try {
        Rank& k = *ranks_[size_t(r)];
        KCUDA_CHECK(cudaSetDevice(k.device));
        ParallelLayout p = layout;
        p.rank = r;
        ModelWeights w = bind_shard(c, ckpt, p);
        const std::vector<HostBuffer> packed = model::pack_strided(c, w);
        k.cfg = model::rank_config(c, p);
        model::CudaModelOptions mo = o.model;
        mo.tp_size = N, mo.tp_rank = r;
        k.model = std::make_unique<model::CudaModel>(k.cfg, w, mo);
      } catch (...) {
        err = std::current_exception();
      }
    });
    t.join();
    if (err) std::rethrow_exception(err);
  }
  // The communicators: NCCL's unique id over an in-process bootstrap group, or the same-device group.
  if (o.one_device) {
    same_ = std::make_unique<parallel::SameDeviceGroup>(N, current);
    for (int r = 0; r < N; ++r) ranks_[size_t(r)]->comm = same_->comm(r, ranks_[size_t(r)]->model->stream());
  } else {
    parallel::InProcessGroup boot(N);
    std::vector<std::unique_ptr<parallel::Comm>> boots;
    for (int r = 0; r < N; ++r) boots.push_back(boot.comm(r));
    run([&](int r) {
      Rank& k = *ranks_[size_t(r)];
      try {
        k.comm = parallel::nccl_comm(*boots[size_t(r)], k.device, k.model->stream());
      } catch (const std::exception& e) {
        boot.abort(e.what());
        throw;
      }
    });
  }
  if (o.custom_all_reduce) {
    // Decode-sized all-reduces through the one-shot kernel; the wrapped comm keeps everything else. Wrapped
    // before attach_comm, so every collective of the model goes through the one decorator.
    std::vector<int> devices;
    for (const auto& k : ranks_) devices.push_back(k->device);
    peer_ = std::make_unique<parallel::PeerAllReduceGroup>(devices);
    for (int r = 0; r < N; ++r) {
      Rank& k = *ranks_[size_t(r)];
      k.comm = peer_->wrap(std::move(k.comm), r, k.model->stream());
    }
  }
  run([&](int r) { ranks_[size_t(r)]->model->attach_comm(ranks_[size_t(r)]->comm.get()); });
}

CudaTpGroup::~CudaTpGroup() {
  // Each rank's comm and model are released on a thread with its device current.
  for (auto& k : ranks_) {
    std::thread t([&k] {
      cudaSetDevice(k->device);
      k.reset();
    });
    t.join();
  }
}

int64_t CudaTpGroup::custom_all_reduces() const { return peer_ ? peer_->calls() : 0; }

int CudaTpGroup::device(int r) const { return ranks_.at(size_t(r))->device; }
const ModelConfig& CudaTpGroup::rank_config(int r) const { return ranks_.at(size_t(r))->cfg; }
model::CudaModel& CudaTpGroup::model(int r) { return *ranks_.at(size_t(r))->model; }

void CudaTpGroup::run(const std::function<void(int)>& fn) {
  const int N = size();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r)
    threads.emplace_back([&, r] {
      try {
        KCUDA_CHECK(cudaSetDevice(ranks_[size_t(r)]->device));
        fn(r);
      } catch (const std::exception& e) {
        std::lock_guard lk(mu);
        if (!first) {
          first = std::current_exception();
          if (same_) same_->abort(fmt::format("rank {} failed: {}", r, e.what()));
        }
      } catch (...) {
        std::lock_guard lk(mu);
        if (!first) {
          first = std::current_exception();
          if (same_) same_->abort(fmt::format("rank {} failed", r));
        }
      }
    });
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

int64_t CudaTpGroup::cache_budget(double utilization, int64_t reserve) {
  std::map<int, int> per_device;
  for (const auto& k : ranks_) ++per_device[k->device];
  int64_t best = std::numeric_limits<int64_t>::max();
  for (const auto& [dev, n] : per_device) {
    std::exception_ptr err;
    int64_t b = 0;
    std::thread t([&, dev = dev, n = n] {
      try {
        KCUDA_CHECK(cudaSetDevice(dev));
        b = cuda_cache_budget(utilization, reserve * n) / n;  // the ranks on one device share it
      } catch (...) {
        err = std::current_exception();
      }
    });
    t.join();
    if (err) std::rethrow_exception(err);
    best = std::min(best, b);
  }
  return best;
}

CudaTpExecutor::CudaTpExecutor(CudaTpGroup& g, const CacheFormats& f, const cache::CacheConfig& cc) : g_(g) {
  execs_.resize(size_t(g.size()));
  g.run([&](int r) {
    CudaExecutorOptions eo;
    eo.cuda_graphs = false;  // not under TP yet (executor_cuda_tp.h)
    eo.follower = r > 0;
    execs_[size_t(r)] = std::make_unique<CudaExecutor>(g.model(r), g.rank_config(r), f, cc, eo);
  });
}

CudaTpExecutor::~CudaTpExecutor() {
  // Each rank's caches are freed with its device current.
  try {
    g_.run([&](int r) { execs_[size_t(r)].reset(); });
  } catch (...) {
  }
}

const ExecutorStats& CudaTpExecutor::stats() const { return execs_.front()->stats(); }

sched::StepResult CudaTpExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  // Which sequences want every position's logits, asked here on the caller's thread, once.
  std::unordered_set<cache::RequestId> all;
  if (hooks.wants_all_logits && hooks.all_logits)
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list)
        if (hooks.wants_all_logits(x.id)) all.insert(x.id);
  const auto wants = [&all](cache::RequestId id) { return all.count(id) > 0; };
  StepHooks lead = hooks;  // rank 0: the engine's sampler (device and host), masks and dumps
  lead.wants_all_logits = wants;
  StepHooks follow;  // the others: only the logits rows must match rank 0's
  follow.wants_all_logits = wants;
  follow.all_logits = [](const sched::ScheduledSeq&, std::span<const float>) {};
  sched::StepResult result;
  g_.run([&](int r) {
    sched::StepResult mine = execs_[size_t(r)]->run(plan, r == 0 ? lead : follow);
    if (r == 0) result = std::move(mine);
  });
  return result;
}

}  // namespace kestrel::runtime
