#include "cohort/core/store/hash_store.h"

#include <algorithm>

#include "cohort/core/error.h"
#include "cohort/core/store/missing_keys.h"

namespace cohort {

void HashStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  changed_.notify_all();
}

std::vector<uint8_t> HashStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::lock_guard<std::mutex> lock(mu_);
  return data_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& bytes = data_[key];
    value = bytes.empty() ? 0 : std::stoll(std::string(bytes.begin(), bytes.end()));
    value += delta;
    auto text = std::to_string(value);
    bytes.assign(text.begin(), text.end());
  }
  changed_.notify_all();
  return value;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return data_.count(k) > 0; });
}

void HashStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_present = [&] {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& k) { return data_.count(k) > 0; });
  };
  if (!changed_.wait_for(lock, timeout, all_present)) {
    std::vector<std::string> missing;
    for (auto& k : keys) {
      if (!data_.count(k)) missing.push_back(k);
    }
    throw TimeoutError(missing_keys_message("HashStore", missing, timeout));
  }
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return data_.erase(key) > 0;
}

}  // namespace cohort
