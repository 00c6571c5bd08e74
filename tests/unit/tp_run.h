// Shared by the tensor-parallel tests (test_tensor_parallel.cpp) and the mpirun twin
// (mpi/mpi_tp_check.cpp): the nano checkpoints by name, and one prefill + greedy decode run of a
// layout whose ranks are the threads of an in-process group, or this process's rank of a given comm.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/shard.h"
#include "model/model.h"
#include "model/tp.h"
#include "parallel/inproc_comm.h"

namespace kestrel::testing {

struct Ckpt {
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
};

inline const Ckpt& checkpoint(const std::string& which) {
  static std::map<std::string, Ckpt>* all = new std::map<std::string, Ckpt>;
  static std::mutex mu;
  std::lock_guard lk(mu);
  auto it = all->find(which);
  if (it != all->end()) return it->second;
  const char* nano = std::getenv("KESTREL_NANO_DIR");
  if (!nano) throw std::runtime_error("KESTREL_NANO_DIR is not set (the ctest fixtures make the checkpoints)");
  const std::string dir = which == "nano" ? std::string(nano) : (std::filesystem::path(nano).parent_path() / which).string();
  Ckpt c;
  c.cfg = load_config(dir);
  c.ckpt = std::make_unique<Checkpoint>(dir);
  return all->emplace(which, std::move(c)).first->second;
}

inline std::vector<int32_t> random_prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = int32_t(rng() % 768);
  return p;
}

struct RankRun {
  std::vector<float> prefill;              // f32 [T, V]
  std::vector<std::vector<float>> decode;  // f32 [V] per greedy step
  std::vector<int32_t> tokens;             // greedy continuation
};

inline int32_t argmax(const float* v, int64_t n) { return int32_t(std::max_element(v, v + n) - v); }

// Prefill `prompt` (every position's logits), then `steps` decodes as rank comm.rank() of layout p
// (p.tp == comm.size()): of the greedy tokens, or of `forced` when given (teacher forcing, so two
// layouts are compared on the same inputs even past a near-tie that one of them breaks the other way).
inline RankRun run_rank(const Ckpt& ck, ParallelLayout p, parallel::Comm& comm, const std::vector<int32_t>& prompt,
                        int steps, const std::vector<int32_t>& forced = {}) {
  const int64_t V = ck.cfg.text.vocab_size, T = int64_t(prompt.size());
  p.rank = comm.rank();
  ModelWeights w = bind_shard(ck.cfg, *ck.ckpt, p);
  const std::vector<HostBuffer> packed = model::pack_strided(ck.cfg, w);
  const ModelConfig rc = model::rank_config(ck.cfg, p);
  model::State st(rc);
  model::ForwardOptions opt;
  opt.comm = p.tp > 1 ? &comm : nullptr;
  opt.dcp = p.dcp;
  RankRun r;  // r.tokens: the greedy choice after the prompt and after each decode
  r.prefill.resize(size_t(T * V));
  model::prefill(w, rc, st, prompt, r.prefill.data(), opt);
  int32_t next = argmax(r.prefill.data() + (T - 1) * V, V);
  for (int s = 0; s < steps; ++s) {
    r.tokens.push_back(next);
    if (!forced.empty()) next = forced.at(size_t(s));
    r.decode.emplace_back(size_t(V));
    model::decode(w, rc, st, next, r.decode.back().data(), opt);
    next = argmax(r.decode.back().data(), V);
  }
  return r;
}

// The same for every rank of p, as threads of one in-process group; one RankRun per rank.
inline std::vector<RankRun> run_layout(const Ckpt& ck, const ParallelLayout& p, const std::vector<int32_t>& prompt,
                                   int steps, const std::vector<int32_t>& forced = {}) {
  std::vector<RankRun> out(size_t(p.tp));
  parallel::run_ranks(p.tp, [&](parallel::Comm& comm) {
    out[size_t(comm.rank())] = run_rank(ck, p, comm, prompt, steps, forced);
  });
  return out;
}

}  // namespace kestrel::testing
