#include "cohort/comm/ucx/collectives.h"

#include "cohort/algorithms/halving_doubling.h"
#include "cohort/algorithms/ring.h"
#include "cohort/core/dtypes.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::ucx {
namespace {

// Position of rank r in a tree rooted at `root`, and back.
int relative(int r, int root, int p) { return (r - root + p) % p; }
int absolute(int v, int root, int p) { return (v + root) % p; }

// Elements per rank: the given counts, or n split evenly.
std::vector<int64_t> counts_or_even(std::vector<int64_t> counts, int64_t n, int p) {
  if (counts.empty()) counts.assign(static_cast<size_t>(p), n / p);
  return counts;
}

template <typename T>
T min_of(T x, T y) {
  if (x != x) return x;  // NaN wins, as in at::minimum
  if (y != y) return y;
  return y < x ? y : x;
}

template <typename T>
T max_of(T x, T y) {
  if (x != x) return x;
  if (y != y) return y;
  return y > x ? y : x;
}

template <typename T>
void combine(T* a, const T* b, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      for (int64_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] + b[i]);
      return;
    case ReduceOp::Prod:
      for (int64_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] * b[i]);
      return;
    case ReduceOp::Min:
      for (int64_t i = 0; i < n; ++i) a[i] = min_of(a[i], b[i]);
      return;
    case ReduceOp::Max:
      for (int64_t i = 0; i < n; ++i) a[i] = max_of(a[i], b[i]);
      return;
    case ReduceOp::Avg:
      break;
  }
  COHORT_CHECK(false, "the communicator turns avg into sum before the engine");
}

}  // namespace

// Every dtype collectives carry that reduces in itself (the 16-bit floats
// accumulate in float32): small_all_reduce combines in the buffer's dtype.
bool small_all_reduce_handles(at::ScalarType dtype) {
  const DtypeInfo* d = find_dtype(dtype);
  return d && d->collective && reduction_dtype(dtype) == dtype;
}

void small_all_reduce(Worker& worker, at::Tensor& buf, at::Tensor& tmp, at::Tensor& tmp_full,
                      ReduceOp op, Clock::time_point deadline, uint32_t fused) {
  void (*reduce)(void*, const void*, int64_t, ReduceOp) = nullptr;
  switch (buf.scalar_type()) {
#define COHORT_UCX_COMBINE(type, name)                                   \
  case at::k##name:                                                      \
    reduce = [](void* a, const void* b, int64_t n, ReduceOp o) {         \
      combine(static_cast<type*>(a), static_cast<const type*>(b), n, o); \
    };                                                                   \
    break;
    COHORT_UCX_COMBINE(float, Float)
    COHORT_UCX_COMBINE(double, Double)
    COHORT_UCX_COMBINE(int32_t, Int)
    COHORT_UCX_COMBINE(int64_t, Long)
    COHORT_UCX_COMBINE(uint8_t, Byte)
#undef COHORT_UCX_COMBINE
    default:
      COHORT_CHECK(false, "small_all_reduce_handles() said no to this dtype");
  }
  const int p = worker.size(), r = worker.rank();
  for (int mask = 1; mask < p; mask <<= 1) {
    const bool check = fused && mask == 1;
    // The send first: the peer waits for it, and posting the receive
    // first (a request and a lock, about 60 ns) delayed it.
    // A peer's message that arrives first waits in UCX's unexpected queue:
    // one more copy of an eager message (at most 8 KiB on shared memory);
    // a rendezvous moves its data only once the receive is posted.
    auto out = worker.post(Channel::Collective, buf, r ^ mask,
                           check ? static_cast<int>(fused) : mask, true);
    auto in = check ? worker.post_check_receive(tmp_full, r ^ mask)
                    : worker.post(Channel::Collective, tmp, r ^ mask, mask, false);
    worker.wait(*in, deadline);
    worker.wait(*out, deadline);
    reduce(buf.data_ptr(), tmp.data_ptr(), buf.numel(), op);
  }
}

void all_reduce(Link& link, at::Tensor& buf, ReduceOp op) {
  if (link.size() == 1) return;
  auto flat = buf.view({-1});
  if (static_cast<int64_t>(buf.nbytes()) <= kHalvingDoublingBytes) {
    algorithms::hd_all_reduce(link, flat, op);
  } else {
    algorithms::ring_all_reduce(link, flat, op);
  }
}

// Binomial tree: a rank receives from the rank that differs in its lowest
// set bit, then sends to the ranks below that bit, largest subtree first.
void broadcast(Link& link, at::Tensor& t, int root) {
  const int p = link.size(), v = relative(link.rank(), root, p);
  int mask = 1;
  while (mask < p && !(v & mask)) mask <<= 1;
  if (v != 0) link.wait(link.recv(t, absolute(v - mask, root, p), 0));
  std::vector<Link::Pending> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < p) sends.push_back(link.send(t, absolute(v + mask, root, p), 0));
  }
  link.wait_all(sends);
}

// The broadcast's tree upside down: a rank adds its children's partial
// results (smallest subtree first), then sends the sum to its parent.
void reduce(Link& link, at::Tensor& t, int root, ReduceOp op) {
  const int p = link.size(), v = relative(link.rank(), root, p);
  if (p == 1) return;
  auto acc = v == 0 ? t : link.scratch(0, t.numel(), t).view(t.sizes()).copy_(t);
  auto in = link.scratch(1, t.numel(), t).view(t.sizes());
  for (int mask = 1; mask < p; mask <<= 1) {
    if (v & mask) {
      link.wait(link.send(acc, absolute(v - mask, root, p), 0));
      return;
    }
    if (v + mask < p) {
      link.wait(link.recv(in, absolute(v + mask, root, p), 0));
      algorithms::reduce_into(acc, acc, in, op);
    }
  }
}

void all_gather(Link& link, std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  const int p = link.size();
  const int64_t n = input.numel();
  auto flat = link.scratch(0, n * p, input);
  const auto blocks = algorithms::equal_spans(n, p);
  flat.narrow(0, blocks[static_cast<size_t>(link.rank())].offset, n).copy_(input.view({-1}));
  algorithms::ring_all_gather(link, flat, blocks);
  for (int r = 0; r < p; ++r) {
    outputs[static_cast<size_t>(r)].view({-1}).copy_(flat.narrow(0, r * n, n));
  }
}

void gather(Link& link, std::vector<at::Tensor>& outputs, const at::Tensor& input, int root) {
  if (link.rank() != root) return link.wait(link.send(input, root, 0));
  std::vector<Link::Pending> recvs;
  for (int r = 0; r < link.size(); ++r) {
    auto& out = outputs[static_cast<size_t>(r)];
    if (r == root) {
      out.copy_(input);
    } else {
      recvs.push_back(link.recv(out, r, 0));
    }
  }
  link.wait_all(recvs);
}

void scatter(Link& link, at::Tensor& output, std::vector<at::Tensor>& inputs, int root) {
  if (link.rank() != root) return link.wait(link.recv(output, root, 0));
  std::vector<Link::Pending> sends;
  for (int r = 0; r < link.size(); ++r) {
    auto& in = inputs[static_cast<size_t>(r)];
    if (r == root) {
      output.copy_(in);
    } else {
      sends.push_back(link.send(in, r, 0));
    }
  }
  link.wait_all(sends);
}

void all_to_all(Link& link, at::Tensor& output, const at::Tensor& input,
                std::vector<int64_t> output_counts, std::vector<int64_t> input_counts) {
  const int p = link.size(), me = link.rank();
  auto out = output.view({-1});
  auto in = input.view({-1});
  output_counts = counts_or_even(std::move(output_counts), out.numel(), p);
  input_counts = counts_or_even(std::move(input_counts), in.numel(), p);
  std::vector<Link::Pending> pending;
  int64_t out_at = 0, in_at = 0;
  for (int r = 0; r < p; ++r) {
    const auto oc = output_counts[static_cast<size_t>(r)];
    const auto ic = input_counts[static_cast<size_t>(r)];
    if (r == me) {
      // Another size in than out is refused on every rank by the check.
      COHORT_CHECK(oc == ic, "all_to_all's own block: " << ic << " elements in, " << oc << " out");
      out.narrow(0, out_at, oc).copy_(in.narrow(0, in_at, ic));
    } else {
      // Receives first, so no message waits in UCX's unexpected queue.
      pending.insert(pending.begin(), link.recv(out.narrow(0, out_at, oc), r, 0));
      pending.push_back(link.send(in.narrow(0, in_at, ic), r, 0));
    }
    out_at += oc;
    in_at += ic;
  }
  link.wait_all(pending);
}

// Dissemination: in round k every rank signals rank + 2^k and waits for
// rank - 2^k; after ceil(log2 p) rounds each has heard from all.
void barrier(Link& link) {
  const int p = link.size(), r = link.rank();
  auto token = link.scratch(0, 2, at::empty({0}, at::kByte));
  for (int k = 1; k < p; k <<= 1) {
    auto recv = link.recv(token.narrow(0, 1, 1), (r - k + p) % p, k);
    auto send = link.send(token.narrow(0, 0, 1), (r + k) % p, k);
    link.wait(recv);
    link.wait(send);
  }
}

}  // namespace cohort::ucx
