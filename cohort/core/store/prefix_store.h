// defines: PrefixStore, a Store decorator that gives a subgroup its own key
// space ("<prefix>/<key>") inside a shared store.
#pragma once

#include <memory>

#include "cohort/core/store/store.h"

namespace cohort {

/// A view of another Store whose keys all start with a prefix: a subgroup's own key space.
class PrefixStore : public Store {
 public:
  /// Keys `k` become `prefix/k` in `inner`.
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;

  /// The prefix added to every key.
  const std::string& prefix() const { return prefix_; }
  /// The store the keys are in.
  const std::shared_ptr<Store>& inner() const { return inner_; }

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace cohort
