#include "cohort/core/rank_local.h"

#include <mutex>
#include <unordered_map>

namespace cohort {
namespace {

// A weak reference keeps a dead TensorImpl's memory (not its storage) until
// the entry is dropped, so an address in the map is never a newer tensor's.
struct Mark {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl;
  bool local = false;           // mark_rank_local's
  std::string part_of, remedy;  // (when local)
  TensorParallelPart tp;        // mark_tensor_parallel_part's ({0, 1}: none)
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

// The live mark of `t`, made for it if it has none (under marks_mutex).
Mark& mark_for(const torch::Tensor& t) {
  auto& all = marks();
  const auto it = all.find(t.unsafeGetTensorImpl());
  if (it != all.end() && !it->second.impl.expired()) return it->second;
  // The entries of tensors that died are dropped here: the map holds live ones.
  for (auto i = all.begin(); i != all.end();) {
    i = i->second.impl.expired() ? all.erase(i) : std::next(i);
  }
  Mark fresh{
      c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()),
      false, "", "", TensorParallelPart{}};
  return all.insert_or_assign(t.unsafeGetTensorImpl(), std::move(fresh)).first->second;
}

}  // namespace

void mark_rank_local(const torch::Tensor& t, std::string part_of, std::string remedy) {
  if (!t.defined()) return;
  std::lock_guard<std::mutex> lock(marks_mutex);
  Mark& mark = mark_for(t);
  mark.local = true;
  mark.part_of = std::move(part_of);
  mark.remedy = std::move(remedy);
}

void mark_tensor_parallel_part(const torch::Tensor& t, int64_t rank, int64_t size,
                               std::string group) {
  if (!t.defined() || size <= 1) return;
  std::lock_guard<std::mutex> lock(marks_mutex);
  mark_for(t).tp = TensorParallelPart{rank, size, std::move(group)};
}

TensorParallelPart tensor_parallel_part(const torch::Tensor& t) {
  std::lock_guard<std::mutex> lock(marks_mutex);
  const Mark* mark = mark_of(t);
  return mark ? mark->tp : TensorParallelPart{};
}

std::string tensor_parallel_part_refusal(const std::string& param, const TensorParallelPart& mine,
                                         int peer, const TensorParallelPart& theirs) {
  auto part = [](const TensorParallelPart& p) {
    return "TP rank " + std::to_string(p.rank) + " of " + std::to_string(p.size) + "'s part";
  };
  const auto& group = mine.size > 1 ? mine.group : theirs.group;
  return param + " holds " + part(mine) + " of a tensor split over the tensor-parallel group '" +
         group + "', but rank " + std::to_string(peer) + " holds " + part(theirs) +
         ": the ranks of this group differ in TP rank (it is not orthogonal to the TP group), "
         "and broadcasting, averaging or sharding over it would mix different parts of one "
         "tensor, a silent wrong model. Build it over the mesh's data-parallel group "
         "(mesh[\"dp\"] of a {\"dp\", \"tp\"} mesh whose \"tp\" the TP layers run over), whose "
         "ranks all hold one TP rank";
}

std::string rank_local_refusal(const std::vector<torch::Tensor>& params,
                               const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(marks_mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    const Mark* mark = mark_of(params[i]);
    if (!mark || !mark->local) continue;
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
