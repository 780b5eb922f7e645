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

// The coalesced forms move one flat buffer of every tensor's bytes: ranks
// whose tensors add up to the same elements but differ in their dtypes or
// their split (the same total and dtypes otherwise) would read each
// other's bytes as their own tensors.
void add_layout_cases(std::vector<SignatureCase>& cases) {
  using Layout = std::vector<std::pair<torch::Dtype, int64_t>>;
  struct Differing {
    const char* name;
    Layout odd, usual;
  };
  const auto f32 = torch::kFloat32, i32 = torch::kInt32;
  const std::vector<Differing> differing = {
      {"DtypeOrder", {{f32, 2}, {i32, 2}}, {{i32, 2}, {f32, 2}}},
      {"Split", {{f32, 3}, {f32, 1}}, {{f32, 1}, {f32, 3}}},
      {"SplitAcrossDtypes", {{f32, 3}, {i32, 1}}, {{f32, 1}, {i32, 3}}},
  };
  auto tensors = [](const Layout& l, int rank) {
    std::vector<torch::Tensor> ts;
    for (const auto& [dtype, n] : l) ts.push_back(torch::full({n}, rank + 1, dtype));
    return ts;
  };
  for (const auto& d : differing) {
    cases.push_back({std::string("BroadcastCoalesced_") + d.name,
                     nullptr,
                     [d, tensors](Communicator& c, bool is_odd) {
                       auto ts = tensors(is_odd ? d.odd : d.usual, c.rank());
                       c.broadcast_coalesced(ts, {0}).wait();
                     },
                     {"broadcast_coalesced", "layout", "differ in dtype or size"},
                     {"broadcast_coalesced"}});
    cases.push_back({std::string("AllReduceCoalesced_") + d.name,
                     nullptr,
                     [d, tensors](Communicator& c, bool is_odd) {
                       auto ts = tensors(is_odd ? d.odd : d.usual, c.rank());
                       c.all_reduce_coalesced(ts).wait();
                     },
                     {"all_reduce_coalesced", "layout", "differ in dtype or size"},
                     {"all_reduce_coalesced"}});
  }
}

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
  add_layout_cases(cases);
  return cases;
}

// How one rank's own block looks in an all_to_all: rows (elements) in the
// input and in the output; every block between two ranks is one row.
struct OwnBlock {
  const char* name;
  int64_t in, out;
};

std::vector<SignatureCase> build_own_block() {
  std::vector<SignatureCase> cases;
  const std::vector<std::string> odd{"all_to_all", "own block"};
  const std::string verdict = "must give a rank's own block the same size";
  // One row into three used to be broadcast into the three; the others, a
  // LibTorch size error on rank 0 alone.
  for (const OwnBlock b :
       {OwnBlock{"1Into3", 1, 3}, OwnBlock{"2Into3", 2, 3}, OwnBlock{"3Into1", 3, 1}}) {
    // The splits rank `me` passes: its own block as `b` on rank 0, else one row.
    auto splits = [b](const Communicator& c, bool is_odd, bool input) {
      std::vector<int64_t> s(static_cast<size_t>(c.size()), 1);
      if (is_odd) s[static_cast<size_t>(c.rank())] = input ? b.in : b.out;
      return s;
    };
    cases.push_back({std::string("AllToAllSingle_OwnBlock") + b.name,
                     nullptr,
                     [splits](Communicator& c, bool is_odd) {
                       const auto in_splits = splits(c, is_odd, true);
                       const auto out_splits = splits(c, is_odd, false);
                       int64_t in_rows = 0, out_rows = 0;
                       for (auto n : in_splits) in_rows += n;
                       for (auto n : out_splits) out_rows += n;
                       auto in = torch::arange(in_rows, torch::kFloat32);
                       auto out = torch::full({out_rows}, -1.0f);
                       c.all_to_all_single(out, in, out_splits, in_splits).wait();
                     },
                     odd,
                     {},
                     verdict});
    cases.push_back({std::string("AllToAll_OwnBlock") + b.name,
                     nullptr,
                     [splits](Communicator& c, bool is_odd) {
                       std::vector<torch::Tensor> ins, outs;
                       const auto in_splits = splits(c, is_odd, true);
                       const auto out_splits = splits(c, is_odd, false);
                       for (int q = 0; q < c.size(); ++q) {
                         ins.push_back(torch::ones({in_splits[static_cast<size_t>(q)]}));
                         outs.push_back(torch::full({out_splits[static_cast<size_t>(q)]}, -1.0f));
                       }
                       c.all_to_all(outs, ins).wait();
                     },
                     odd,
                     {},
                     verdict});
  }
  return cases;
}

}  // namespace

const std::vector<SignatureCase>& signature_cases() {
  static const auto cases = build();
  return cases;
}

const std::vector<SignatureCase>& own_block_cases() {
  static const auto cases = build_own_block();
  return cases;
}

double run_signature_case(Communicator& comm, const SignatureCase& c) {
  const bool odd = comm.rank() == 0;
  const bool alone = comm.size() == 1;
  if (c.prologue) c.prologue(comm);
  const auto start = Clock::now();
  std::string message;
  try {
    c.call(comm, odd);
    ADD_FAILURE() << "rank " << comm.rank() << ": the call completed";
  } catch (const MismatchError& e) {
    message = e.what();
    EXPECT_FALSE(alone) << "alone, a MismatchError: " << message;
  } catch (const InvalidArgument& e) {
    message = e.what();
    EXPECT_TRUE(alone) << "rank " << comm.rank() << ": an InvalidArgument: " << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << comm.rank() << ": not a MismatchError: " << e.what();
  }
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(s, kBoundSeconds) << "rank " << comm.rank() << " waited for a timeout";
  if (message.empty()) return s;
  const std::string where =
      " on rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
  EXPECT_NE(message.find(where), std::string::npos) << where << " missing from: " << message;
  for (const auto* words : {&c.odd_words, &c.usual_words}) {
    if (alone && words == &c.usual_words) break;  // no other rank called
    for (const auto& w : *words) {
      EXPECT_NE(message.find(w), std::string::npos)
          << "rank " << comm.rank() << ": '" << w << "' missing from: " << message;
    }
  }
  EXPECT_NE(message.find(c.verdict), std::string::npos) << message;
  return s;
}

}  // namespace cohort::testing
