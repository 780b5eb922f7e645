// GradientReducer: the bucket layout and the progress of its one rebuild,
// saved and adopted, so that a resumed run reduces in the buckets (and
// rebuilds at the step) of the run that saved it: a comm hook's state
// (error feedback, PowerSGD's Q) is keyed by bucket index.
#include <string>

#include "cohort/core/error.h"
#include "cohort/grad_sync/gradient_reducer.h"

namespace cohort {
namespace {

// Bucket sizes, then every bucket's parameter indices, in launch order.
constexpr const char* kSizes = "ddp_layout_sizes";
constexpr const char* kParams = "ddp_layout_params";
// kRecording: the first synchronizing backward has not run; kPending: it
// recorded kReadyOrder (this rank's), the rebuild comes at the next
// forward; kRebuilt: the rebuild is done.
constexpr const char* kPhase = "ddp_layout_phase";
constexpr const char* kReadyOrder = "ddp_layout_ready_order";
enum Phase : int64_t { kRecording = 0, kPending = 1, kRebuilt = 2 };

torch::Tensor longs(const std::vector<int64_t>& v) {
  return torch::tensor(v, torch::kLong).clone();
}

std::vector<int64_t> values(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous().view({-1});
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// Whether v holds each of 0..n-1 once.
bool is_permutation(const std::vector<int64_t>& v, size_t n) {
  if (v.size() != n) return false;
  std::vector<char> seen(n, 0);
  for (int64_t i : v) {
    if (i < 0 || i >= static_cast<int64_t>(n) || seen[i]) return false;
    seen[i] = 1;
  }
  return true;
}

}  // namespace

std::map<std::string, torch::Tensor> GradientReducer::layout_state() const {
  std::vector<int64_t> sizes, params;
  for (const auto& b : buckets_) {
    sizes.push_back(static_cast<int64_t>(b.params.size()));
    params.insert(params.end(), b.params.begin(), b.params.end());
  }
  const Phase phase = rebuilt_ ? kRebuilt : order_recorded_ ? kPending : kRecording;
  std::map<std::string, torch::Tensor> out{
      {kSizes, longs(sizes)}, {kParams, longs(params)}, {kPhase, longs({phase})}};
  if (phase == kPending) {
    out[kReadyOrder] = longs(std::vector<int64_t>(ready_order_.begin(), ready_order_.end()));
  }
  return out;
}

void GradientReducer::check_layout_state(const std::map<std::string, torch::Tensor>& state) const {
  auto refuse = [&](const std::string& why) {
    throw ConfigError("DistributedDataParallel on rank " + std::to_string(comm_->rank()) +
                      ": the bucket layout saved with the comm hook's state does not fit this "
                      "model's " +
                      std::to_string(params_.size()) + " parameters with requires_grad (" + why +
                      "); resume with the model that wrote it");
  };
  auto get = [&](const char* name) {
    auto it = state.find(name);
    if (it == state.end()) refuse(std::string("no ") + name);
    return values(it->second);
  };
  const auto phase = get(kPhase);
  if (phase.size() != 1 || phase[0] < kRecording || phase[0] > kRebuilt) refuse("bad phase");
  if (phase[0] == kPending && !is_permutation(get(kReadyOrder), params_.size())) {
    refuse("the recorded gradient order is not a permutation of the parameters");
  }
  const auto params = get(kParams);
  if (!is_permutation(params, params_.size())) {
    refuse("the buckets' parameters are not a permutation of the parameters");
  }
  size_t at = 0;
  for (int64_t size : get(kSizes)) {
    if (size <= 0 || at + static_cast<size_t>(size) > params.size()) refuse("bad bucket sizes");
    for (int64_t k = 0; k < size; ++k) {
      if (params_[params[at + k]].scalar_type() != params_[params[at]].scalar_type()) {
        refuse("a bucket holds parameters of two dtypes");
      }
    }
    at += static_cast<size_t>(size);
  }
  if (at != params.size()) refuse("bad bucket sizes");
}

void GradientReducer::load_layout_state(const std::map<std::string, torch::Tensor>& state) {
  check_layout_state(state);
  refuse_with_leaves("load_layout_state");
  if (backward_started_ && !backward_finished_) {
    throw InvalidArgument("DistributedDataParallel: load_layout_state on rank " +
                          std::to_string(comm_->rank()) + " during a backward pass");
  }
  const auto params = values(state.at(kParams));
  std::vector<std::vector<size_t>> closed;
  size_t at = 0;
  for (int64_t size : values(state.at(kSizes))) {
    closed.emplace_back(params.begin() + at, params.begin() + at + size);
    at += static_cast<size_t>(size);
  }
  const auto before = bucket_layout();
  install_buckets(std::move(closed));
  const auto phase = values(state.at(kPhase))[0];
  ready_order_.clear();
  if (phase == kPending) {
    for (int64_t i : values(state.at(kReadyOrder))) ready_order_.push_back(static_cast<size_t>(i));
  }
  order_recorded_ = phase != kRecording;
  rebuilt_ = phase == kRebuilt;
  stats_.buckets_rebuilt = rebuilt_;
  tell_hook_changed(before);
}

}  // namespace cohort
