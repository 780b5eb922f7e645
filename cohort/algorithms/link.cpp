#include "cohort/algorithms/link.h"

#include <algorithm>

#include "cohort/core/error.h"

namespace cohort::algorithms {

std::vector<Span> even_spans(int64_t n, int parts) {
  std::vector<Span> spans(static_cast<size_t>(parts));
  const int64_t base = n / parts, extra = n % parts;
  int64_t offset = 0;
  for (int i = 0; i < parts; ++i) {
    spans[i] = {offset, base + (i < extra ? 1 : 0)};
    offset += spans[i].count;
  }
  return spans;
}

std::vector<Span> equal_spans(int64_t each, int parts) {
  std::vector<Span> spans(static_cast<size_t>(parts));
  for (int i = 0; i < parts; ++i) spans[i] = {i * each, each};
  return spans;
}

int64_t segment_elements(const at::Tensor& t) {
  return std::max<int64_t>(1, kSegmentBytes / static_cast<int64_t>(t.element_size()));
}

void reduce_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      at::add_out(out, a, b);
      return;
    case ReduceOp::Prod:
      at::mul_out(out, a, b);
      return;
    case ReduceOp::Min:
      at::minimum_out(out, a, b);
      return;
    case ReduceOp::Max:
      at::maximum_out(out, a, b);
      return;
    case ReduceOp::Avg:
      break;
  }
  throw InvalidArgument("cohort: algorithms reduce with sum, min, max or prod; avg is a sum "
                        "divided by the communicator");
}

at::Tensor Scratch::get(int slot, int64_t n, const at::TensorOptions& options) {
  if (slots_.size() <= static_cast<size_t>(slot)) slots_.resize(static_cast<size_t>(slot) + 1);
  const int64_t bytes = n * static_cast<int64_t>(options.dtype().itemsize());
  auto& raw = slots_[static_cast<size_t>(slot)];
  if (!raw.defined() || raw.numel() < bytes) raw = at::empty({bytes}, at::kByte);
  return raw.narrow(0, 0, bytes).view(options.dtype().toScalarType());
}

Link::Link(PointToPoint& transport, std::string what, Clock::time_point deadline, Scratch* scratch)
    : transport_(transport),
      what_(std::move(what)),
      deadline_(deadline),
      rank_(transport.rank()),
      size_(transport.size()),
      scratch_(scratch) {}

at::Tensor Link::scratch(int slot, int64_t n, const at::Tensor& like) {
  if (!scratch_) return at::empty({n}, like.options());
  return scratch_->get(slot, n, like.options());
}

void Link::wait(const WorkPtr& work, const std::string& step) {
  const auto left = std::chrono::duration_cast<Millis>(deadline_ - Clock::now());
  try {
    work->wait(std::max(left, Millis(1)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(what_ + ": " + step + " did not complete: " + e.what());
  } catch (const MismatchError& e) {
    throw MismatchError(what_ + ": " + step + " failed: " + e.what());
  } catch (const std::exception& e) {
    throw PeerError(what_ + ": " + step + " failed: " + e.what());
  }
}

// Empty transfers are skipped on both sides: both compute the same sizes.
Link::Pending Link::send(at::Tensor t, int peer, int tag) {
  if (t.numel() == 0) return {nullptr, peer, true};
  return {transport_.send(t, peer, tag), peer, true};
}

Link::Pending Link::recv(at::Tensor t, int peer, int tag) {
  if (t.numel() == 0) return {nullptr, peer, false};
  return {transport_.recv(t, peer, tag), peer, false};
}

void Link::wait(const Pending& p) {
  if (!p.work) return;
  const auto left = std::chrono::duration_cast<Millis>(deadline_ - Clock::now());
  const std::string where =
      what_ + ": " + (p.is_send ? "send to" : "receive from") + " rank " + std::to_string(p.peer);
  try {
    p.work->wait(std::max(left, Millis(1)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(where + " did not complete: " + e.what());
  } catch (const MismatchError& e) {
    // An engine that sees the ranks disagree (UCX: a message of another size).
    throw MismatchError(where + " failed: " + e.what());
  } catch (const PeerError& e) {
    throw PeerError(where + " failed: " + e.what());
  } catch (const std::exception& e) {
    throw PeerError(where + " failed: " + e.what());
  }
}

void Link::wait_all(std::vector<Pending>& ps) {
  for (auto& p : ps) wait(p);
  ps.clear();
}

}  // namespace cohort::algorithms

namespace cohort::algorithms {

void exchange(Link& link, int peer, const at::Tensor& out, const at::Tensor& in,
              const std::function<void(int64_t, int64_t)>& on_segment) {
  const int64_t seg = segment_elements(in.defined() ? in : out);
  std::vector<Link::Pending> recvs, sends;
  const int64_t n_in = in.defined() ? in.numel() : 0;
  const int64_t n_out = out.defined() ? out.numel() : 0;
  for (int64_t k = 0; k * seg < n_in; ++k) {
    recvs.push_back(link.recv(in.narrow(0, k * seg, std::min(seg, n_in - k * seg)), peer,
                              static_cast<int>(k)));
  }
  for (int64_t k = 0; k * seg < n_out; ++k) {
    sends.push_back(link.send(out.narrow(0, k * seg, std::min(seg, n_out - k * seg)), peer,
                              static_cast<int>(k)));
  }
  for (size_t k = 0; k < recvs.size(); ++k) {
    link.wait(recvs[k]);
    const int64_t begin = static_cast<int64_t>(k) * seg;
    if (on_segment) on_segment(begin, std::min(seg, n_in - begin));
  }
  link.wait_all(sends);
}

}  // namespace cohort::algorithms
