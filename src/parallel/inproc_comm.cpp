// In-process communicator: the protocol is described in inproc_comm.h.
#include "parallel/inproc_comm.h"

#include <cstring>
#include <exception>
#include <thread>

#include "core/check.h"

namespace kestrel::parallel {
namespace {

const char* op_name(int op) {
  static const char* names[] = {"all_reduce_sum", "all_gather", "reduce_scatter_sum", "broadcast", "all_to_all",
                                "barrier"};
  return op >= 0 && op < 6 ? names[op] : "?";
}

}  // namespace

class InProcessComm final : public Comm {
 public:
  InProcessComm(InProcessGroup* g, int rank) : g_(g), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return g_->size_; }
  std::string backend() const override { return "inproc"; }
  Device device() const override { return Device::cpu; }

  void all_reduce_sum(void* buf, size_t count, DType dt) override {
    check_reduce_dtype(dt, "all_reduce_sum");
    publish(InProcessGroup::Op::all_reduce, buf, count, dt, 0);
    scratch_.resize(comm_bytes(count, dt));
    std::vector<const void*> parts(static_cast<size_t>(size()));
    for (int p = 0; p < size(); ++p) parts[size_t(p)] = g_->slots_[size_t(p)].send;
    sum_in_rank_order(parts.data(), size(), scratch_.data(), count, dt);
    finish(buf);
  }

  void all_gather(const void* send, void* recv, size_t count, DType dt) override {
    publish(InProcessGroup::Op::all_gather, send, count, dt, 0);
    const size_t b = comm_bytes(count, dt);
    scratch_.resize(comm_bytes(count * size_t(size()), dt));
    for (int p = 0; p < size(); ++p) copy(scratch_.data() + size_t(p) * b, g_->slots_[size_t(p)].send, b);
    finish(recv);
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) override {
    check_reduce_dtype(dt, "reduce_scatter_sum");
    publish(InProcessGroup::Op::reduce_scatter, send, count, dt, 0);
    const size_t b = comm_bytes(count, dt);
    scratch_.resize(b);
    std::vector<const void*> parts(static_cast<size_t>(size()));
    for (int p = 0; p < size(); ++p)
      parts[size_t(p)] = static_cast<const uint8_t*>(g_->slots_[size_t(p)].send) + size_t(rank_) * b;
    sum_in_rank_order(parts.data(), size(), scratch_.data(), count, dt);
    finish(recv);
  }

  void broadcast(void* buf, size_t count, DType dt, int root) override {
    KCHECK(root >= 0 && root < size(), "broadcast root {} outside [0, {})", root, size());
    publish(InProcessGroup::Op::broadcast, buf, count, dt, root);
    scratch_.resize(comm_bytes(count, dt));
    copy(scratch_.data(), g_->slots_[size_t(root)].send, scratch_.size());
    finish(buf);
  }

  void all_to_all(const void* send, void* recv, size_t count, DType dt) override {
    publish(InProcessGroup::Op::all_to_all, send, count, dt, 0);
    const size_t b = comm_bytes(count, dt);
    scratch_.resize(comm_bytes(count * size_t(size()), dt));
    for (int p = 0; p < size(); ++p)
      copy(scratch_.data() + size_t(p) * b,
           static_cast<const uint8_t*>(g_->slots_[size_t(p)].send) + size_t(rank_) * b, b);
    finish(recv);
  }

  void barrier() override { publish(InProcessGroup::Op::barrier, nullptr, 0, DType::u8, 0); g_->wait_all(); }

 private:
  static void copy(void* dst, const void* src, size_t n) {
    if (n) std::memcpy(dst, src, n);
  }

  // Phase 1: publish this rank's call, wait for everyone, check that all ranks made the same call.
  void publish(InProcessGroup::Op op, const void* send, size_t count, DType dt, int root) {
    InProcessGroup::Slot& s = g_->slots_[size_t(rank_)];
    s.op = op;
    s.send = send;
    s.count = count;
    s.dt = dt;
    s.root = root;
    g_->wait_all();
    const InProcessGroup::Slot& a = g_->slots_[0];
    for (int p = 1; p < size(); ++p) {
      const InProcessGroup::Slot& b = g_->slots_[size_t(p)];
      if (b.op != a.op || b.count != a.count || b.dt != a.dt || b.root != a.root)
        fail("in-process collective mismatch: rank 0 called {}(count {}, {}, root {}) but rank {} called {}(count {}, "
             "{}, root {})",
             op_name(int(a.op)), a.count, dtype_name(a.dt), a.root, p, op_name(int(b.op)), b.count, dtype_name(b.dt),
             b.root);
    }
  }

  // Phase 2: everyone has read what it needs; write the private result into the receive buffer.
  void finish(void* recv) {
    g_->wait_all();
    copy(recv, scratch_.data(), scratch_.size());
  }

  InProcessGroup* g_;
  int rank_;
  std::vector<uint8_t> scratch_;
};

InProcessGroup::InProcessGroup(int size) : size_(size) {
  if (size < 1) fail("in-process group needs at least one rank, got {}", size);
  slots_.resize(size_t(size));
}

std::unique_ptr<Comm> InProcessGroup::comm(int rank) {
  KCHECK(rank >= 0 && rank < size_, "rank {} outside [0, {})", rank, size_);
  return std::make_unique<InProcessComm>(this, rank);
}

void InProcessGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!aborted_) {
    aborted_ = true;
    abort_msg_ = why;
  }
  cv_.notify_all();
}

void InProcessGroup::wait_all() {
  std::unique_lock<std::mutex> lk(mu_);
  if (aborted_) throw Error("in-process group aborted: " + abort_msg_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
  if (generation_ == gen) throw Error("in-process group aborted: " + abort_msg_);
}

void run_ranks(int n, const std::function<void(Comm&)>& fn) {
  InProcessGroup group(n);
  std::mutex mu;
  std::exception_ptr first;
  auto body = [&](int r) {
    try {
      std::unique_ptr<Comm> c = group.comm(r);
      fn(*c);
    } catch (...) {
      std::string what = "rank " + std::to_string(r) + " failed";
      try {
        throw;
      } catch (const std::exception& e) {
        what += ": " + std::string(e.what());
      } catch (...) {
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) first = std::current_exception();
      }
      group.abort(what);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(n));
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace kestrel::parallel
