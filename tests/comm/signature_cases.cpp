#include "tests/comm/signature_cases.h"

#include <gtest/gtest.h>

#include "cohort/core/error.h"

namespace cohort::testing {
namespace {

using Clock = std::chrono::steady_clock;

// How one rank calls a collective.
struct Variant {
  int64_t n = 4;  // elements per rank
  torch::Dtype dtype = torch::kFloat32;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
};

struct Kind {
  const char* name;    // the case's name
  const char* called;  // how messages name it
  bool reduces = false;
  bool rooted = false;
  bool sized = true;
  ReduceOp other_op = ReduceOp::Max;  // the op mismatch: this against sum
  int64_t extra = 0;                  // elements beyond n (the coalesced forms' second tensor)
  void (*run)(Communicator&, const Variant&);
};

torch::Tensor ones(const Variant& v, int64_t n) { return torch::ones({n}, v.dtype); }
std::vector<torch::Tensor> list(const Variant& v, int count, int64_t n) {
  std::vector<torch::Tensor> l;
  for (int i = 0; i < count; ++i) l.push_back(ones(v, n));
  return l;
}

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> k = {
      {"AllReduce", "all_reduce", true, false, true, ReduceOp::Avg, 0,
       [](Communicator& c, const Variant& v) {
         auto t = ones(v, v.n);
         AllReduceOptions o;
         o.op = v.op;
         c.all_reduce(t, o).wait();
       }},
      {"AllReduceCoalesced", "all_reduce_coalesced", true, false, true, ReduceOp::Avg, 2,
       [](Communicator& c, const Variant& v) {
         std::vector<torch::Tensor> ts{ones(v, v.n), ones(v, 2)};
         AllReduceOptions o;
         o.op = v.op;
         c.all_reduce_coalesced(ts, o).wait();
       }},
      {"Broadcast", "broadcast", false, true, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto t = ones(v, v.n);
         BroadcastOptions o;
         o.root = v.root;
         c.broadcast(t, o).wait();
       }},
      {"BroadcastCoalesced", "broadcast_coalesced", false, true, true, ReduceOp::Max, 2,
       [](Communicator& c, const Variant& v) {
         std::vector<torch::Tensor> ts{ones(v, v.n), ones(v, 2)};
         BroadcastOptions o;
         o.root = v.root;
         c.broadcast_coalesced(ts, o).wait();
       }},
      {"Reduce", "reduce", true, true, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto t = ones(v, v.n);
         ReduceOptions o;
         o.root = v.root;
         o.op = v.op;
         c.reduce(t, o).wait();
       }},
      {"AllGather", "all_gather", false, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto outs = list(v, c.size(), v.n);
         c.all_gather(outs, ones(v, v.n)).wait();
       }},
      {"AllGatherIntoTensor", "all_gather", false, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto out = ones(v, v.n * c.size());
         c.all_gather_into_tensor(out, ones(v, v.n)).wait();
       }},
      {"ReduceScatter", "reduce_scatter", true, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto out = ones(v, v.n);
         ReduceScatterOptions o;
         o.op = v.op;
         c.reduce_scatter(out, list(v, c.size(), v.n), o).wait();
       }},
      {"ReduceScatterTensor", "reduce_scatter", true, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto out = ones(v, v.n);
         ReduceScatterOptions o;
         o.op = v.op;
         c.reduce_scatter_tensor(out, ones(v, v.n * c.size()), o).wait();
       }},
      {"Gather", "gather", false, true, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         std::vector<torch::Tensor> outs;
         if (c.rank() == v.root) outs = list(v, c.size(), v.n);
         GatherOptions o;
         o.root = v.root;
         c.gather(outs, ones(v, v.n), o).wait();
       }},
      {"Scatter", "scatter", false, true, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         std::vector<torch::Tensor> ins;
         if (c.rank() == v.root) ins = list(v, c.size(), v.n);
         auto out = ones(v, v.n);
         ScatterOptions o;
         o.root = v.root;
         c.scatter(out, ins, o).wait();
       }},
      {"AllToAll", "all_to_all", false, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto outs = list(v, c.size(), v.n);
         c.all_to_all(outs, list(v, c.size(), v.n)).wait();
       }},
      {"AllToAllSingle", "all_to_all", false, false, true, ReduceOp::Max, 0,
       [](Communicator& c, const Variant& v) {
         auto out = ones(v, v.n * c.size());
         c.all_to_all_single(out, ones(v, v.n * c.size())).wait();
       }},
      {"Barrier", "barrier", false, false, false, ReduceOp::Max, 0,
       [](Communicator& c, const Variant&) { c.barrier().wait(); }},
  };
  return k;
}

std::string elements(int64_t n) { return std::to_string(n) + " elements"; }

std::vector<SignatureCase> build() {
  std::vector<SignatureCase> cases;
  for (const auto& k : kinds()) {
    const auto run = k.run;
    const std::string name = k.name;
    const Variant usual;
    auto differing = [&](const std::string& what, Variant odd, std::vector<std::string> ow,
                         std::vector<std::string> uw) {
      ow.insert(ow.begin(), k.called);
      uw.insert(uw.begin(), k.called);
      cases.push_back(
          {name + "_" + what, nullptr,
           [run, odd, usual](Communicator& c, bool is_odd) { run(c, is_odd ? odd : usual); }, ow,
           uw});
    };
    if (k.sized) {
      Variant v;
      v.n = 5;
      differing("Size", v, {elements(5 + k.extra)}, {elements(4 + k.extra)});
      v.n = 0;  // nothing to move on one rank
      differing("Empty", v, {elements(k.extra)}, {elements(4 + k.extra)});
      v = Variant{};
      v.dtype = torch::kInt32;
      differing("Dtype", v, {"int32"}, {"float32"});
    }
    if (k.reduces) {
      Variant v;
      v.op = k.other_op;
      differing("Op", v, {to_string(k.other_op)}, {"sum"});
    }
    if (k.rooted) {
      Variant v;
      v.root = 1;
      differing("Root", v, {"root 1"}, {"root 0"});
    }
    // Another kind: all_reduce, or reduce_scatter against all_reduce.
    const bool is_all_reduce = name == "AllReduce";
    const auto& other = kinds()[is_all_reduce ? 8 : 0];
    cases.push_back({name + "_Kind",
                     nullptr,
                     [run, other_run = other.run](Communicator& c, bool is_odd) {
                       (is_odd ? run : other_run)(c, Variant{});
                     },
                     {k.called},
                     {other.called}});
    // One more call than the others, who go on to a barrier (or an
    // all_reduce after barriers).
    const auto& next = kinds()[name == "Barrier" ? 0 : kinds().size() - 1];
    cases.push_back({name + "_NumberOfCalls",
                     [run](Communicator& c) { run(c, Variant{}); },
                     [run, next_run = next.run](Communicator& c, bool is_odd) {
                       (is_odd ? run : next_run)(c, Variant{});
                     },
                     {k.called},
                     {next.called}});
  }
  return cases;
}

}  // namespace

const std::vector<SignatureCase>& signature_cases() {
  static const auto cases = build();
  return cases;
}

double run_signature_case(Communicator& comm, const SignatureCase& c) {
  const bool odd = comm.rank() == 0;
  if (c.prologue) c.prologue(comm);
  const auto start = Clock::now();
  std::string message;
  try {
    c.call(comm, odd);
    ADD_FAILURE() << "rank " << comm.rank() << ": the call completed";
  } catch (const MismatchError& e) {
    message = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << comm.rank() << ": not a MismatchError: " << e.what();
  }
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(s, kBoundSeconds) << "rank " << comm.rank() << " waited for a timeout";
  if (message.empty()) return s;
  for (const auto* words : {&c.odd_words, &c.usual_words}) {
    for (const auto& w : *words) {
      EXPECT_NE(message.find(w), std::string::npos)
          << "rank " << comm.rank() << ": '" << w << "' missing from: " << message;
    }
  }
  EXPECT_NE(message.find("the ranks called different collectives"), std::string::npos) << message;
  return s;
}

}  // namespace cohort::testing
