// The one file that talks to c10d. Needs -DUSE_C10D_GLOO.
#include "cohort/comm/gloo/c10d_adapter.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cohort/comm/c10d_common.h"
#include "cohort/core/error.h"
#include "cohort/core/signature.h"
#include "cohort/core/store/missing_keys.h"
#include "cohort/core/tensor_checks.h"

namespace cohort {
namespace {

using namespace c10d_common;  // the adapters' shared part

// A cohort Store over a c10d store (FileStore).
class C10dStore : public cohort::Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> inner, std::string name, Millis timeout)
      : inner_(std::move(inner)), name_(std::move(name)) {
    timeout_ = timeout;
    inner_->setTimeout(timeout);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    guard([&] { inner_->set(key, value); });
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    std::vector<uint8_t> out;
    guard([&] { out = inner_->get(key); });
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    guard([&] { out = inner_->add(key, delta); });
    return out;
  }
  bool check(const std::vector<std::string>& keys) override {
    bool out = false;
    guard([&] { out = inner_->check(keys); });
    return out;
  }
  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    try {
      inner_->wait(keys, timeout);
    } catch (const std::exception& e) {
      std::vector<std::string> missing;
      for (auto& k : keys) {
        if (!inner_->check({k})) missing.push_back(k);
      }
      if (missing.empty()) throw Error(name_ + ": " + c10d_message(e));
      throw TimeoutError(missing_keys_message(name_, missing, timeout));
    }
  }
  bool delete_key(const std::string& key) override {
    bool out = false;
    guard([&] { out = inner_->deleteKey(key); });
    return out;
  }

 private:
  template <typename F>
  void guard(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw Error(name_ + ": " + c10d_message(e));
    }
  }
  c10::intrusive_ptr<c10d::Store> inner_;
  std::string name_;
};

// The point-to-point tag of the signature checks (user tags below it).
constexpr int kCheckTag = std::numeric_limits<int32_t>::max();

WorkPtr failed_work(std::exception_ptr error) {
  return c10d_common::failed_work("gloo signature check", std::move(error));
}

// Data moves as bytes. c10d's Gloo dispatches each collective on the
// tensor's dtype, and its builds differ in the dtypes they know (Debian's
// LibTorch 2.14 knows no 16-bit one: "Invalid scalar type"); every build
// moves uint8 (byte_view: a view of the tensor's memory, never a copy).
// Reductions keep their dtype (no 16-bit one reaches an engine: the
// Communicator reduces those in float32).
std::vector<at::Tensor> byte_views(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(byte_view(t));
  return out;
}

// A point-to-point message's header: its payload's bytes and the caller's
// dtype (CallerDtypeScope: bf16 moves as float16 bits).
struct MessageHeader {
  int64_t bytes, dtype;
  static MessageHeader of(const at::Tensor& t) {
    return {t.numel() * static_cast<int64_t>(t.element_size()),
            static_cast<int64_t>(caller_dtype_or(t.scalar_type()))};
  }
  at::Tensor words() const {
    auto w = at::empty({2}, at::kLong);
    auto* p = w.data_ptr<int64_t>();
    p[0] = bytes;
    p[1] = dtype;
    return w;
  }
};

// Gloo hands a message to whatever receive its tag matches, whatever its
// size: a shorter one leaves a stale tail in the buffer, another dtype of
// the same bytes is read as the buffer's. The receive completes only when
// the header that came first agrees with the buffer, else MismatchError on
// the receiver (the sender's send has completed). A longer message still
// ends the process inside Gloo (an enforce on its I/O thread, before cohort
// sees the header): only a payload posted after its header arrived could
// stop that, which costs every message a round trip.
class CheckedReceive : public WorkImpl {
 public:
  CheckedReceive(WorkPtr header, WorkPtr payload, at::Tensor received, MessageHeader expected,
                 std::string what)
      : parts_({std::move(header), std::move(payload)}),
        received_(std::move(received)),
        expected_(expected),
        what_(std::move(what)) {}

  bool is_completed() override { return parts_.is_completed(); }

  void wait(Millis timeout) override {
    parts_.wait(timeout);
    const auto* got = received_.data_ptr<int64_t>();
    if (got[0] == expected_.bytes && got[1] == expected_.dtype) return;
    throw MismatchError(what_ + ": " +
                        bad_message(got[0], static_cast<int>(got[1]), expected_.bytes,
                                    static_cast<int>(expected_.dtype), "is", "the receive buffer"));
  }

 private:
  WorkList parts_;
  at::Tensor received_;
  MessageHeader expected_;
  std::string what_;
};

// Every collective first compares its signature (cohort/core/signature.h)
// with every other rank's, 32 bytes each way per peer on point-to-point,
// whose sizes never differ: Gloo aborts the process (an enforce on its own
// thread) when a collective's sizes differ across ranks, so the check must
// end before Gloo sees the data. Each rank compares all the others itself,
// so all of them refuse a collective that any two called differently.
class GlooEngine : public Engine {
 public:
  GlooEngine(c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options,
             c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, std::shared_ptr<cohort::Store> store)
      : options_(std::move(options)), pg_(std::move(pg)), store_(std::move(store)) {}

  std::string name() const override { return "gloo"; }
  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }

  WorkPtr all_reduce(at::Tensor& tensor, ReduceOp op) override {
    if (auto failed = check(given_or(CollectiveKind::AllReduce, tensor, -1, op))) return failed;
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    return call([&] { return pg_->allreduce(ts, o); });
  }

  WorkPtr broadcast(at::Tensor& tensor, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Broadcast, tensor, root))) return failed;
    std::vector<at::Tensor> ts{byte_view(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return call([&] { return pg_->broadcast(ts, o); });
  }

  WorkPtr reduce(at::Tensor& tensor, int root, ReduceOp op) override {
    if (auto failed = check(given_or(CollectiveKind::Reduce, tensor, root, op))) return failed;
    std::vector<at::Tensor> ts{tensor};
    c10d::ReduceOptions o;
    o.rootRank = root;
    o.reduceOp = to_c10d(op);
    return call([&] { return pg_->reduce(ts, o); });
  }

  // ProcessGroupGloo gathers into a flat buffer it allocates per call and
  // copies each rank's part out of it.
  bool gathers_into_outputs() const override { return false; }

  WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    if (auto failed = check(given_or(CollectiveKind::AllGather, input))) return failed;
    std::vector<std::vector<at::Tensor>> out{byte_views(outputs)};
    std::vector<at::Tensor> in{byte_view(input)};
    return call([&] { return pg_->allgather(out, in); });
  }

  WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Gather, input, root))) return failed;
    std::vector<std::vector<at::Tensor>> out;
    if (!outputs.empty()) out.push_back(byte_views(outputs));
    std::vector<at::Tensor> in{byte_view(input)};
    c10d::GatherOptions o;
    o.rootRank = root;
    return call([&] { return pg_->gather(out, in, o); });
  }

  WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Scatter, output, root))) return failed;
    std::vector<at::Tensor> out{byte_view(output)};
    std::vector<std::vector<at::Tensor>> in;
    if (!inputs.empty()) in.push_back(byte_views(inputs));
    c10d::ScatterOptions o;
    o.rootRank = root;
    return call([&] { return pg_->scatter(out, in, o); });
  }

  WorkPtr all_to_all(at::Tensor& output, at::Tensor& input,
                     std::vector<int64_t>& output_counts,
                     std::vector<int64_t>& input_counts) override {
    const auto c = all_to_all_check(output, input, output_counts, input_counts, size());
    if (auto failed = check(c.signature, c.send, c.recv)) return failed;
    auto out = byte_view(output), in = byte_view(input);
    const auto bytes = [n = input.element_size()](std::vector<int64_t> counts) {
      for (auto& c : counts) c *= n;
      return counts;  // (empty stays empty: equal splits of the bytes)
    };
    auto out_counts = bytes(output_counts), in_counts = bytes(input_counts);
    return call([&] { return pg_->alltoall_base(out, in, out_counts, in_counts); });
  }

  WorkPtr barrier() override {
    if (auto failed = check(take_signature().value_or(Signature{}))) return failed;
    return call([&] { return pg_->barrier(); });
  }

  // A send is two Gloo messages on its tag: its header, then the payload.
  // Gloo keeps a pair's messages of one tag in order, so a receive posts
  // both receives at once and the data moves as soon as it would alone
  // (CheckedReceive). The two posts are one step under the peer's mutex:
  // another thread's send or receive between them would pair one message's
  // header with another's payload. The payload is checked before the
  // header goes: c10d refusing it after would leave a header unpaired.
  WorkPtr send(at::Tensor& tensor, int dst, int tag) override {
    check_tag(tag, "send");
    check_payload(tensor, dst, "send");
    std::vector<at::Tensor> hs{MessageHeader::of(tensor).words()}, ts{tensor};
    std::lock_guard<std::mutex> lock(peer_mu_[dst]);
    auto header = call([&] { return pg_->send(hs, dst, tag); }, false);
    auto payload = call([&] { return pg_->send(ts, dst, tag); }, false);
    return std::make_shared<WorkList>(std::vector<WorkPtr>{header, payload});
  }

  WorkPtr recv(at::Tensor& tensor, int src, int tag) override {
    check_tag(tag, "recv");
    check_payload(tensor, src, "recv");
    std::vector<at::Tensor> hs{at::empty({2}, at::kLong)}, ts{tensor};
    std::lock_guard<std::mutex> lock(peer_mu_[src]);
    auto header = call([&] { return pg_->recv(hs, src, tag); }, false);
    auto payload = call([&] { return pg_->recv(ts, src, tag); }, false);
    return std::make_shared<CheckedReceive>(
        header, payload, hs[0], MessageHeader::of(tensor),
        "gloo: receive from rank " + std::to_string(src) + " (tag " + std::to_string(tag) + ")");
  }

  std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                          std::shared_ptr<cohort::Store> store,
                                          Millis timeout) override {
    const int me = member_index(ranks, rank());
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices = options_->devices;
    options->threads = options_->threads;
    return connect(std::move(store), me, static_cast<int>(ranks.size()), options);
  }

  static std::unique_ptr<Engine> connect(
      std::shared_ptr<cohort::Store> store, int rank, int size,
      c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options) {
    publish_process(*store, rank);
    auto bridge = c10::make_intrusive<StoreBridge>(store);
    try {
      auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(bridge, rank, size, options);
      // A rank's side of a pair can finish connecting before its peer's has
      // read the handshake; a rank that then dropped the group at once made
      // the peer's constructor fail with "Connection closed by peer". No
      // rank leaves this barrier before every rank has connected.
      pg->barrier()->wait();
      return std::make_unique<GlooEngine>(std::move(options), std::move(pg), std::move(store));
    } catch (const cohort::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow_translated(e);
    }
  }

 private:
  // A collective's Work probes its group when its wait times out, under
  // the number its check gave it (the same on every rank).
  template <typename F>
  WorkPtr call(F&& launch, bool collective = true) {
    Probe probe;
    if (collective && size() > 1) probe = group_probe(store_, rank(), size(), collectives_);
    try {
      return std::make_shared<C10dWork>(launch(), std::move(probe));
    } catch (const std::exception& e) {
      rethrow_translated(e);
    }
  }

  // What c10d would refuse of a point-to-point payload (checkSingleTensor)
  // and its peer, before the header is posted.
  void check_payload(const at::Tensor& t, int peer, const char* what) const {
    if (peer < 0 || peer >= size() || !t.defined() || t.is_sparse() || !t.is_contiguous()) {
      throw InvalidArgument(std::string("engine gloo: ") + what + " with rank " +
                            std::to_string(peer) + " of " + std::to_string(size()) +
                            " needs a peer in range and a defined, dense, contiguous tensor");
    }
  }

  static void check_tag(int tag, const char* what) {
    if (tag == kCheckTag) {
      throw InvalidArgument(std::string("engine gloo: ") + what + " tag " + std::to_string(tag) +
                            " is reserved for the collectives' checks");
    }
  }

  // Null when every rank called this collective as this one did; else a
  // failed Work (MismatchError naming both calls, or the check's own
  // error). An all_to_all compares, per peer, the elements sent with those
  // expected.
  WorkPtr check(Signature s, const std::vector<int64_t>& send = {},
                const std::vector<int64_t>& recv = {}) {
    const int p = size(), me = rank();
    if (p == 1) return nullptr;
    s.seq = ++collectives_;
    // Row q: sent to (received from) rank q. Plain buffers, waited for
    // below: the check is the engine's, not tensor memory the caller's
    // MemoryScope should count.
    std::vector<int64_t> mine_rows(static_cast<size_t>(p * kSignatureWords));
    std::vector<int64_t> their_rows(mine_rows.size());
    auto mine = at::from_blob(mine_rows.data(), {p, kSignatureWords}, at::kLong);
    auto theirs = at::from_blob(their_rows.data(), {p, kSignatureWords}, at::kLong);
    fill_rows(s, send, p, mine_rows.data());
    const auto timeout = s.timeout.count() > 0 ? s.timeout : options_->timeout;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto left = [&] {
      return std::max(Millis(1), std::chrono::duration_cast<Millis>(
                                     deadline - std::chrono::steady_clock::now()));
    };
    // Receives first, against one deadline: the rows that never came name
    // the peers that did not call, all of them, not only the first waited
    // for (a peer that stopped, or one still in an earlier collective).
    std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> recvs, sends;
    std::vector<int> silent;
    int peer = -1;  // whose exchange is being waited for
    try {
      for (int q = 0; q < p; ++q) {
        if (q == me) continue;
        std::vector<at::Tensor> out{mine[q]}, in{theirs[q]};
        sends.emplace_back(q, pg_->send(out, q, kCheckTag));
        recvs.emplace_back(q, pg_->recv(in, q, kCheckTag));
      }
      for (auto& [q, w] : recvs) {
        peer = q;
        try {
          w->wait(left());
        } catch (const std::exception& e) {
          if (!says_timeout(c10d_message(e))) throw;
          silent.push_back(q);
        }
      }
      if (!silent.empty()) {
        return failed_work(std::make_exception_ptr(TimeoutError(
            "gloo: the check of collective #" + std::to_string(s.seq) + " (this rank called " +
            s.describe() + ") timed out: " + silent_peers_message(silent, timeout))));
      }
      for (auto& [q, w] : sends) {
        peer = q;
        w->wait(left());
      }
    } catch (const std::exception& e) {
      // A peer that never calls is a TimeoutError, as the collective's own
      // wait would be; one that closed, a PeerError.
      const std::string what = "gloo: the check of collective #" + std::to_string(s.seq) +
                               " (this rank called " + s.describe() + ") with rank " +
                               std::to_string(peer) + " failed: ";
      try {
        rethrow_translated(e);
      } catch (const TimeoutError& t) {
        return failed_work(std::make_exception_ptr(TimeoutError(what + t.what())));
      } catch (const Error& t) {
        return failed_work(std::make_exception_ptr(PeerError(what + t.what())));
      }
    }
    const auto differs = compare_rows("gloo", s, recv, me, p, their_rows.data());
    if (differs.empty()) return nullptr;
    return failed_work(std::make_exception_ptr(MismatchError(differs)));
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::shared_ptr<cohort::Store> store_;  // the group's: the liveness probe's
  // Per peer: a message's two posts are one step (send, recv).
  std::unique_ptr<std::mutex[]> peer_mu_{new std::mutex[static_cast<size_t>(pg_->getSize())]};
  int64_t collectives_ = 0;  // checked so far
};

}  // namespace

std::unique_ptr<Engine> make_gloo_engine(std::shared_ptr<Store> store, int rank, int size,
                                         const GlooOptions& options, Millis timeout) {
  auto o = c10d::ProcessGroupGloo::Options::create(timeout);
  try {
    o->devices.push_back(
        options.interface.empty()
            ? c10d::ProcessGroupGloo::createDeviceForHostname(options.bind_address)
            : c10d::ProcessGroupGloo::createDeviceForInterface(options.interface));
  } catch (const std::exception& e) {
    throw ConfigError("gloo: cannot bind to " +
                      (options.interface.empty() ? "address " + options.bind_address
                                                 : "interface " + options.interface) +
                      ": " + c10d_message(e));
  }
  o->threads = options.threads;
  return GlooEngine::connect(std::move(store), rank, size, o);
}

std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       Millis timeout) {
  try {
    auto fs = c10::make_intrusive<c10d::FileStore>(path, world_size);
    return std::make_shared<C10dStore>(std::move(fs), "FileStore " + path, timeout);
  } catch (const std::exception& e) {
    throw ConfigError("cannot open FileStore at " + path + ": " + c10d_message(e));
  }
}

}  // namespace cohort
