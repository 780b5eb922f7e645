// PipelineRuntime's tied weights (PipelineStage::tie): the keys agreed over
// the pipeline group at construction, one TiedCopies each, and the step's
// gradients of the copies summed over their ranks.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/pipeline/pipeline_runtime.h"

namespace cohort::pipeline {
namespace {

// This rank's declarations as text: "key\0stage,stage\0" per key.
std::string declarations_text(const std::map<std::string, std::vector<int>>& stages) {
  std::string text;
  for (const auto& [key, list] : stages) {
    text += key;
    text += '\0';
    for (size_t i = 0; i < list.size(); ++i) text += (i ? "," : "") + std::to_string(list[i]);
    text += '\0';
  }
  return text;
}

void read_declarations(const std::string& text, std::map<std::string, std::set<int>>& into) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t key_end = text.find('\0', at);
    const size_t list_end = text.find('\0', key_end + 1);
    std::set<int>& stages = into[text.substr(at, key_end - at)];
    std::istringstream list(text.substr(key_end + 1, list_end - key_end - 1));
    for (std::string s; std::getline(list, s, ',');) stages.insert(std::stoi(s));
    at = list_end + 1;
  }
}

// Why this rank's declarations cannot be kept, or "": a tie() call that its
// stage refused (an empty key, a tensor not the stage's), or a conflict. One
// tensor under two keys would be summed over both keys' holders, its
// gradient counted twice (or mixed with another weight's); two tensors of
// one stage under one key are two weights that the stage's forward uses
// apart.
std::string conflict(const std::vector<PipelineStage>& stages) {
  std::map<const void*, std::pair<std::string, int>> key_of;  // tensor -> (key, stage)
  for (const auto& stage : stages) {
    if (!stage.refused_tie().empty()) return stage.refused_tie();
  }
  for (const auto& stage : stages) {
    const std::string here = "stage " + std::to_string(stage.index());
    std::map<std::string, const void*> tensor_of;
    for (const auto& [key, tensor] : stage.tied()) {
      const void* impl = tensor.unsafeGetTensorImpl();
      if (!tensor_of.emplace(key, impl).second && tensor_of[key] != impl)
        return here + " ties two of its tensors as '" + key +
               "' (a stage holds one copy of a tied weight)";
      const auto [it, fresh] = key_of.emplace(impl, std::make_pair(key, stage.index()));
      if (!fresh && it->second.first != key)
        return here + " ties as '" + key + "' the tensor that stage " +
               std::to_string(it->second.second) + " ties as '" + it->second.first +
               "' (one tensor under two keys would have its gradient summed once per key)";
    }
  }
  return "";
}

}  // namespace

void PipelineRuntime::tie_weights(const std::string& who) {
  // Each key's copies on this rank (one tensor once: two local stages may
  // share it) and the stages declaring it.
  std::map<std::string, std::vector<torch::Tensor>> copies;
  std::map<std::string, std::vector<int>> local_stages;
  for (const auto& stage : stages_) {
    for (const auto& [key, tensor] : stage.tied()) {
      local_stages[key].push_back(stage.index());
      auto& list = copies[key];
      const bool held = std::any_of(list.begin(), list.end(),
                                    [&](const torch::Tensor& t) { return t.is_same(tensor); });
      if (!held) list.push_back(tensor);
    }
  }
  // Every rank builds every key's TiedCopies in the same (key) order, a
  // rank without the key too: the construction is collective.
  // Each rank's conflict travels with its declarations, so that every rank
  // refuses the same misuse.
  std::map<std::string, std::set<int>> declared;
  const auto texts =
      gather_texts(*group_, conflict(stages_) + '\0' + declarations_text(local_stages));
  for (size_t r = 0; r < texts.size(); ++r) {
    const size_t end = texts[r].find('\0');
    if (end > 0)
      throw InvalidArgument(who + "rank " + std::to_string(r) + ": " + texts[r].substr(0, end) +
                            " (PipelineStage::tie)");
  }
  for (const auto& text : texts) read_declarations(text.substr(text.find('\0') + 1), declared);
  // A key of one stage in a pipeline of several is most likely misspelt on
  // the others, whose copies would then drift apart.
  for (const auto& [key, stages] : declared) {
    if (stages.size() < 2 && schedule_.num_stages > 1)
      throw InvalidArgument(who + "tied weight '" + key + "' is declared by stage " +
                            std::to_string(*stages.begin()) +
                            " only (PipelineStage::tie on every stage holding a copy)");
  }
  // The original is the lowest stage's copy (the first in this rank's list).
  for (const auto& [key, stages] : declared) {
    auto it = copies.find(key);
    const bool held = it != copies.end();
    const int64_t order = held ? local_stages[key].front() : -1;
    tied_.push_back(
        {key,
         {stages.begin(), stages.end()},
         std::make_shared<TiedCopies>(*group_, held ? it->second : std::vector<torch::Tensor>{},
                                      key, who, order)});
  }
}

void PipelineRuntime::set_tied_grads_aside() {
  // The step adds its gradients into fresh .grad tensors, so that only its
  // own part is summed over the ranks: gradients accumulated over earlier
  // steps were summed then, and would be counted again.
  tied_aside_.clear();
  for (const auto& tied : tied_) {
    for (const auto& copy : tied.copies->copies()) {
      tied_aside_.push_back(copy.grad());
      copy.mutable_grad() = torch::Tensor();
    }
  }
}

void PipelineRuntime::restore_tied_grads(bool sum) {
  std::vector<torch::Tensor> aside = std::move(tied_aside_);
  tied_aside_.clear();
  if (sum) {
    for (auto& tied : tied_) tied.copies->sum_gradients();
  }
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& tied : tied_) {
    for (const auto& copy : tied.copies->copies()) {
      torch::Tensor before = i < aside.size() ? aside[i] : torch::Tensor();
      ++i;
      if (!before.defined()) continue;
      // The same .grad tensor as before the step, what it held plus the step's.
      if (copy.grad().defined()) before.add_(copy.grad());
      copy.mutable_grad() = before;
    }
  }
}

}  // namespace cohort::pipeline
