// A token sink for engine tests: each request's events by the test's key, checked as they come — token indices in
// order, nothing after the final event — with a global order of tokens and finals, and an optional callback on the
// engine thread when a request has n tokens (to submit or cancel from inside a run). Used by the async-scheduling
// and the speculation engine tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "request/engine.h"
#include "request/request.h"

namespace kestrel::testing {

class EngineEvents {
 public:
  struct Out {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    std::vector<int64_t> order;  // global event number of each token
    FinishReason reason = FinishReason::none;
    std::string error;
    int finals = 0;
    int64_t final_order = -1;
  };
  TokenSink sink(int key, std::function<void(size_t)> on_token = {}) {
    return [this, key, on_token](TokenEvent&& ev) {
      size_t n = 0;
      {
        std::lock_guard<std::mutex> lk(mu_);
        Out& o = out_[key];
        EXPECT_EQ(o.finals, 0) << "request " << key << ": an event after its final one";
        if (ev.token >= 0) {
          EXPECT_EQ(ev.index, int32_t(o.tokens.size())) << "request " << key;
          o.tokens.push_back(ev.token);
          o.logprobs.push_back(ev.logprob);
          o.order.push_back(next_++);
          n = o.tokens.size();
        }
        if (ev.finished()) o.reason = ev.finish, o.error = ev.error, ++o.finals, o.final_order = next_++;
      }
      if (n > 0 && on_token) on_token(n);
    };
  }
  std::map<int, Out> all() {
    std::lock_guard<std::mutex> lk(mu_);
    return out_;
  }
  Out get(int key) {
    std::lock_guard<std::mutex> lk(mu_);
    return out_[key];
  }

 private:
  std::mutex mu_;
  std::map<int, Out> out_;
  int64_t next_ = 0;
};

}  // namespace kestrel::testing
