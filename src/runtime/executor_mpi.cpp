// The CPU twin's engine across processes (see executor_mpi.h).
#include "runtime/executor_mpi.h"

#include <cstring>

#include "core/check.h"
#include "parallel/comm.h"
#include "runtime/executor_tp.h"

namespace kestrel::runtime {
namespace {

enum Kind : int64_t { kSetup = 1, kStep = 2, kStop = 3 };

// A flat little int64 stream (every field of the plan is an integer); cheap next to a forward.
struct Writer {
  std::vector<int64_t> v;
  void put(int64_t x) { v.push_back(x); }
  template <typename T>
  void list(const std::vector<T>& xs) {
    put(int64_t(xs.size()));
    for (const T& x : xs) put(int64_t(x));
  }
};
struct Reader {
  std::span<const int64_t> v;
  size_t at = 0;
  int64_t get() {
    if (at >= v.size()) fail("mpi step message: truncated at field {}", at);
    return v[at++];
  }
  int64_t count(int64_t max) {
    const int64_t n = get();
    if (n < 0 || n > max) fail("mpi step message: count {} outside [0, {}]", n, max);
    return n;
  }
  template <typename T>
  std::vector<T> list() {
    std::vector<T> xs(size_t(count(int64_t(v.size()))));
    for (T& x : xs) x = T(get());
    return xs;
  }
};

void put_seq(Writer& w, const sched::ScheduledSeq& x, bool all) {
  w.put(int64_t(x.id)), w.put(x.start), w.put(x.end), w.put(x.sample), w.put(x.reset_state), w.put(x.state_slot);
  w.put(all);
  w.list(x.tokens);
  w.list(x.block_table);
}
sched::ScheduledSeq get_seq(Reader& r, std::unordered_set<cache::RequestId>& all) {
  sched::ScheduledSeq x;
  x.id = cache::RequestId(r.get());
  x.start = r.get(), x.end = r.get();
  x.sample = r.get() != 0, x.reset_state = r.get() != 0;
  x.state_slot = cache::SlotId(r.get());
  if (r.get() != 0) all.insert(x.id);
  x.tokens = r.list<int32_t>();
  x.block_table = r.list<cache::PageId>();
  return x;
}
void put_copies(Writer& w, const std::vector<cache::SlotCopy>& cs) {
  w.put(int64_t(cs.size()));
  for (const cache::SlotCopy& c : cs) w.put(c.src), w.put(c.dst), w.put(int64_t(c.phase));
}
std::vector<cache::SlotCopy> get_copies(Reader& r) {
  std::vector<cache::SlotCopy> cs(size_t(r.count(int64_t(r.v.size()))));
  for (cache::SlotCopy& c : cs) {
    c.src = cache::SlotId(r.get()), c.dst = cache::SlotId(r.get());
    c.phase = cache::CopyPhase(r.get());
  }
  return cs;
}

// One message from rank 0: header {kind, bytes} then the payload (followers: `payload` is resized).
void send(parallel::Comm& world, int64_t kind, std::vector<uint8_t> payload) {
  int64_t head[2] = {kind, int64_t(payload.size())};
  world.broadcast(head, 2, DType::i64, 0);
  if (!payload.empty()) world.broadcast(payload.data(), payload.size(), DType::u8, 0);
}
int64_t receive(parallel::Comm& world, std::vector<uint8_t>& payload) {
  int64_t head[2] = {0, 0};
  world.broadcast(head, 2, DType::i64, 0);
  if (head[1] < 0 || head[1] > (int64_t(1) << 31)) fail("mpi message of {} bytes from rank 0", head[1]);
  payload.resize(size_t(head[1]));
  if (head[1] > 0) world.broadcast(payload.data(), payload.size(), DType::u8, 0);
  return head[0];
}

std::vector<uint8_t> bytes_of(const std::vector<int64_t>& v) {
  std::vector<uint8_t> b(v.size() * 8);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}
std::vector<int64_t> words_of(std::span<const uint8_t> b) {
  if (b.size() % 8 != 0) fail("mpi message: {} bytes, not whole int64 words", b.size());
  std::vector<int64_t> v(b.size() / 8);
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Rank 0's executor: broadcast the step, then run rank 0's forward and sample.
class MpiTpExecutor final : public StepExecutor {
 public:
  MpiTpExecutor(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout, std::shared_ptr<MpiLead> lead,
                const kestrel::CacheFormats& f, const cache::CacheConfig& cc, const ExecutorOptions& o)
      : lead_(std::move(lead)) {
    lead_->setup(f, cc);  // the followers build their ranks while rank 0 builds its own
    rank_ = make_tp_rank(c, ckpt, layout, 0, f, cc, o);
  }
  ~MpiTpExecutor() override {
    try {
      lead_->stop();
    } catch (...) {
    }
  }
  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override {
    const std::unordered_set<cache::RequestId> all = tp_all_logits(plan, hooks);
    lead_->step(plan, all);
    const TpHooks h = tp_hooks(hooks, all);
    return rank_->exec->run_rank(plan, h.lead, &lead_->world());
  }
  const ExecutorStats& stats() const override { return rank_->exec->stats(); }

 private:
  std::shared_ptr<MpiLead> lead_;
  std::unique_ptr<TpRank> rank_;
};

}  // namespace

std::vector<uint8_t> encode_step(const sched::StepPlan& plan, const std::unordered_set<cache::RequestId>& all) {
  Writer w;
  w.put(int64_t(plan.step));
  for (const auto* list : {&plan.decodes, &plan.prefills}) {
    w.put(int64_t(list->size()));
    for (const sched::ScheduledSeq& x : *list) put_seq(w, x, all.count(x.id) > 0);
  }
  put_copies(w, plan.copies_before);
  put_copies(w, plan.copies_after);
  w.list(plan.preempted);
  w.list(plan.finished);
  w.list(plan.cancelled);
  w.put(plan.num_tokens);
  return bytes_of(w.v);
}

sched::StepPlan decode_step(std::span<const uint8_t> bytes, std::unordered_set<cache::RequestId>& all) {
  const std::vector<int64_t> words = words_of(bytes);
  Reader r{words};
  sched::StepPlan p;
  p.step = uint64_t(r.get());
  for (auto* list : {&p.decodes, &p.prefills}) {
    const int64_t n = r.count(int64_t(words.size()));
    for (int64_t i = 0; i < n; ++i) list->push_back(get_seq(r, all));
  }
  p.copies_before = get_copies(r);
  p.copies_after = get_copies(r);
  p.preempted = r.list<cache::RequestId>();
  p.finished = r.list<cache::RequestId>();
  p.cancelled = r.list<cache::RequestId>();
  p.num_tokens = r.get();
  if (r.at != words.size()) fail("mpi step message: {} trailing words", words.size() - r.at);
  return p;
}

void MpiLead::setup(const kestrel::CacheFormats& f, const cache::CacheConfig& cc) {
  KCHECK(!stopped_, "mpi: the followers were already stopped");
  const std::vector<int64_t> v = {f.block_size,     int64_t(f.latent),          int64_t(f.index_keys),
                                  int64_t(f.kda_state), cc.num_pages,          cc.num_state_slots,
                                  cc.block_size,    cc.enable_prefix_cache, cc.hash_bits};
  send(world_, kSetup, bytes_of(v));
}

void MpiLead::step(const sched::StepPlan& plan, const std::unordered_set<cache::RequestId>& all) {
  KCHECK(!stopped_, "mpi: the followers were already stopped");
  send(world_, kStep, encode_step(plan, all));
}

void MpiLead::stop() {
  if (stopped_) return;
  stopped_ = true;
  send(world_, kStop, {});
}

ExecutorFactory mpi_tp_executor_factory(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                        std::shared_ptr<MpiLead> lead, const ExecutorOptions& options) {
  check_layout(c, layout);
  KCHECK(lead->world().size() == layout.tp && lead->world().rank() == 0,
         "--tensor-parallel-size {} under mpirun needs exactly {} processes (got {})", layout.tp, layout.tp,
         lead->world().size());
  return [&c, &ckpt, layout, lead, options](const kestrel::CacheFormats& f, const cache::CacheConfig& cc) {
    return std::unique_ptr<StepExecutor>(std::make_unique<MpiTpExecutor>(c, ckpt, layout, lead, f, cc, options));
  };
}

void run_mpi_follower(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                      parallel::Comm& world, const ExecutorOptions& options) {
  KCHECK(world.size() == layout.tp && world.rank() > 0, "mpi follower: rank {} of {} for TP{}", world.rank(),
         world.size(), layout.tp);
  std::vector<uint8_t> msg;
  const int64_t first = receive(world, msg);
  if (first == kStop) return;  // rank 0 failed before building its executor
  KCHECK(first == kSetup, "mpi follower: expected the setup message, got kind {}", first);
  const std::vector<int64_t> v = words_of(msg);
  KCHECK(v.size() == 9, "mpi follower: setup message of {} words", v.size());
  kestrel::CacheFormats f;
  f.block_size = int(v[0]), f.latent = LatentFormat(v[1]), f.index_keys = IndexKeyFormat(v[2]);
  f.kda_state = KdaStateDtype(v[3]);
  cache::CacheConfig cc;
  cc.num_pages = int32_t(v[4]), cc.num_state_slots = int32_t(v[5]), cc.block_size = int(v[6]);
  cc.enable_prefix_cache = v[7] != 0, cc.hash_bits = int(v[8]);
  const std::unique_ptr<TpRank> rank = make_tp_rank(c, ckpt, layout, world.rank(), f, cc, options);
  const StepHooks none;  // replaced per step by tp_hooks' follower hooks
  for (;;) {
    const int64_t kind = receive(world, msg);
    if (kind == kStop) return;
    KCHECK(kind == kStep, "mpi follower: unexpected message kind {}", kind);
    std::unordered_set<cache::RequestId> all;
    const sched::StepPlan plan = decode_step(msg, all);
    const TpHooks h = tp_hooks(none, all);
    rank->exec->run_rank(plan, h.follow, &world);
  }
}

}  // namespace kestrel::runtime
