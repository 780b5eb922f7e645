#include "cohort/core/store/prefix_store.h"

namespace cohort {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
    : prefix_(std::move(prefix)), inner_(std::move(inner)) {
  timeout_ = inner_->timeout();
}

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (auto& k : keys) out.push_back(full(k));
  return out;
}

void PrefixStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  inner_->set(full(key), value);
}

std::vector<uint8_t> PrefixStore::get(const std::string& key) {
  // Our own timeout, not the inner store's: a subgroup may be stricter.
  inner_->wait({full(key)}, timeout_);
  return inner_->get(full(key));
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return inner_->add(full(key), delta);
}

bool PrefixStore::check(const std::vector<std::string>& keys) { return inner_->check(full(keys)); }

void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  inner_->wait(full(keys), timeout);
}

bool PrefixStore::delete_key(const std::string& key) { return inner_->delete_key(full(key)); }

}  // namespace cohort
