// defines: what the two c10d adapters (gloo/ and nccl/) share: c10d's
// errors as cohort's, the bridge that lets c10d rendezvous through a cohort
// Store, the Work wrapper and the reduce op.
//
// The one header that names c10d: only the adapters' .cpp files include it
// (it is internal), so the rest of cohort still never sees c10d's
// version-specific classes.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "cohort/comm/gloo/liveness_probe.h"
#include "cohort/core/engine.h"
#include "cohort/core/error.h"
#include "cohort/core/job_work.h"
#include "cohort/core/signature.h"
#include "cohort/core/store/store.h"
#include "cohort/core/torch_compat.h"

namespace cohort::c10d_common {

// c10d error text without LibTorch's C++ backtrace.
inline std::string c10d_message(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

inline bool says_timeout(const std::string& m) {
  return m.find("imed out") != std::string::npos || m.find("imeout") != std::string::npos;
}

[[noreturn]] inline void rethrow_translated(const std::exception& e) {
  const auto m = c10d_message(e);
  if (says_timeout(m)) throw TimeoutError(m);
  throw PeerError(m);
}

// Lets c10d rendezvous through a cohort Store (TcpStore, HashStore, ...).
class StoreBridge : public c10d::Store {
 public:
  explicit StoreBridge(std::shared_ptr<cohort::Store> inner)
      : c10d::Store(inner->timeout()), inner_(std::move(inner)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    inner_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    inner_->wait({key}, timeout_);
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->delete_key(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { throw Unsupported("cohort stores do not count their keys"); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }
#if COHORT_C10D_STORE_HAS_CLONE
  // The copy shares the cohort store, whose clients are thread-safe; over a
  // TcpStore it shares its one connection too, so a call through the copy
  // waits behind one through the original. c10d clones only to split or
  // shrink a group, which cohort never asks of it.
  c10::intrusive_ptr<c10d::Store> clone() override {
    auto copy = c10::make_intrusive<StoreBridge>(inner_);
    copy->setTimeout(timeout_);
    return copy;
  }
#endif

 private:
  std::shared_ptr<cohort::Store> inner_;
};

// What a timed-out collective asks before it reports (liveness_probe.h);
// empty for point-to-point, whose one peer the caller already names.
using Probe = std::function<std::string(Millis waited)>;

// The probe of collective `seq` of a group (the same number on every rank).
inline Probe group_probe(std::shared_ptr<cohort::Store> store, int rank, int size, int64_t seq) {
  return [store = std::move(store), rank, size, seq](Millis waited) {
    const auto most = std::clamp(waited / 2, Millis(500), Millis(5000));
    return store_liveness_probe(*store, rank, size, seq, most);
  };
}

// How a Work's wait() waits. Host: the calling thread blocks until the
// operation finished or the timeout passed (Gloo's only way). Stream: the
// caller's current CUDA stream waits for the operation's event and the host
// does not (c10d's synchronize(), NCCL's wait()); errors c10d already saw
// are thrown.
enum class WaitMode { Host, Stream };

class C10dWork : public WorkImpl {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, Probe probe, WaitMode mode = WaitMode::Host)
      : work_(std::move(work)), probe_(std::move(probe)), mode_(mode) {}

  bool is_completed() override {
    try {
      return work_->isCompleted();
    } catch (const std::exception& e) {
      rethrow_translated(e);
    }
  }

  void wait(Millis timeout) override {
    try {
      if (mode_ == WaitMode::Stream) {
        // An error the watchdog already recorded (a timeout, an aborted
        // communicator) is thrown here; a later one, at a later wait.
        if (work_->isCompleted()) {
          if (auto error = work_->exception()) std::rethrow_exception(error);
        }
        work_->synchronize();
      } else {
        work_->wait(timeout);
      }
    } catch (const std::exception& e) {
      const auto m = c10d_message(e);
      if (probe_ && says_timeout(m)) throw TimeoutError(m + probe_(timeout));
      rethrow_translated(e);
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Probe probe_;
  WaitMode mode_;
};

// This rank's place among `ranks` (a new subgroup's, in its order).
inline int member_index(const std::vector<int>& ranks, int rank) {
  const auto at = std::find(ranks.begin(), ranks.end(), rank);
  COHORT_CHECK(at != ranks.end(), "caller is not a member");
  return static_cast<int>(at - ranks.begin());
}

// What an all_to_all's signature check compares: its signature (no single
// count) and the elements it sends each peer and expects from each (the
// counts given, else an equal split).
struct AllToAllCheck {
  Signature signature;
  std::vector<int64_t> send, recv;
};
inline AllToAllCheck all_to_all_check(const at::Tensor& output, const at::Tensor& input,
                                      const std::vector<int64_t>& output_counts,
                                      const std::vector<int64_t>& input_counts, int size) {
  AllToAllCheck c{given_or(CollectiveKind::AllToAll, input), input_counts, output_counts};
  c.signature.count = -1;
  const auto p = static_cast<size_t>(size);
  if (c.send.empty()) c.send.assign(p, input.numel() / size);
  if (c.recv.empty()) c.recv.assign(p, output.numel() / size);
  return c;
}

// A Work that already failed with `error` (a signature check's verdict).
inline WorkPtr failed_work(const char* what, std::exception_ptr error) {
  auto w = std::make_shared<JobWork>(what);
  w->finish(std::move(error));
  return w;
}

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Prod:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::Avg:
      break;
  }
  COHORT_CHECK(false, "the communicator turns avg into sum before the engine");
}

}  // namespace cohort::c10d_common
