#include "cohort/core/rank_local.h"

#include <mutex>
#include <unordered_map>

namespace cohort {
namespace {

// A weak reference keeps a dead TensorImpl's memory (not its storage) until
// the entry is dropped, so an address in the map is never a newer tensor's.
struct Mark {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl;
  std::string part_of, remedy;
};

std::mutex marks_mutex;
std::unordered_map<const c10::TensorImpl*, Mark>& marks() {
  static auto* all = new std::unordered_map<const c10::TensorImpl*, Mark>();
  return *all;
}

// The live mark of `t`, or null (under marks_mutex).
const Mark* mark_of(const torch::Tensor& t) {
  if (!t.defined()) return nullptr;
  const auto it = marks().find(t.unsafeGetTensorImpl());
  return it == marks().end() || it->second.impl.expired() ? nullptr : &it->second;
}

}  // namespace

void mark_rank_local(const torch::Tensor& t, std::string part_of, std::string remedy) {
  if (!t.defined()) return;
  std::lock_guard<std::mutex> lock(marks_mutex);
  auto& all = marks();
  // The entries of tensors that died are dropped here: the map holds live ones.
  for (auto it = all.begin(); it != all.end();) {
    it = it->second.impl.expired() ? all.erase(it) : std::next(it);
  }
  all.insert_or_assign(
      t.unsafeGetTensorImpl(),
      Mark{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()),
           std::move(part_of), std::move(remedy)});
}

std::string rank_local_refusal(const std::vector<torch::Tensor>& params,
                               const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(marks_mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    const Mark* mark = mark_of(params[i]);
    if (!mark) continue;
    const std::string name =
        i < names.size() ? "'" + names[i] + "'" : "number " + std::to_string(i);
    return "parameter " + name + " holds only this rank's part of " + mark->part_of +
           ", and this mode takes every parameter for one tensor replicated over its group (it "
           "would broadcast one rank's part over the others', average different parts' "
           "gradients or save one rank's part as the whole); " +
           mark->remedy;
  }
  return "";
}

}  // namespace cohort
