// FakeBackend: see backends.h.
#include "server/backends.h"

#include <random>
#include <thread>


namespace kestrel::server {

namespace {
struct FakeState : Backend::SeqState {
  std::mt19937_64 rng;
  size_t emitted = 0;
};
}  // namespace

void FakeBackend::load() { std::this_thread::sleep_for(opt_.load_delay); }

std::unique_ptr<Backend::SeqState> FakeBackend::new_state() { return std::make_unique<FakeState>(); }

void FakeBackend::fill(SeqState& s, float* logits) {
  auto& f = static_cast<FakeState&>(s);
  if (!opt_.script.empty()) {
    std::fill(logits, logits + opt_.vocab_size, 0.0f);
    logits[opt_.script[f.emitted % opt_.script.size()]] = 20.0f;
  } else {
    std::normal_distribution<float> n(0.0f, 2.0f);
    for (int64_t i = 0; i < opt_.vocab_size; ++i) logits[i] = n(f.rng);
  }
  ++f.emitted;
}

void FakeBackend::prefill(SeqState& s, std::span<const int32_t> tokens, float* logits) {
  uint64_t h = 1469598103934665603ull;  // prompt hash: the same prompt gives the same random stream
  for (int32_t t : tokens) h = (h ^ uint64_t(t)) * 1099511628211ull;
  static_cast<FakeState&>(s).rng.seed(h);
  fill(s, logits);
}

void FakeBackend::decode(SeqState& s, int32_t, float* logits) { fill(s, logits); }

void FakeBackend::end_of_round() {
  if (opt_.round_delay.count() > 0) std::this_thread::sleep_for(opt_.round_delay);
}

}  // namespace kestrel::server
