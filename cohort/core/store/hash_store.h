// defines: HashStore, an in-process Store for ranks that run as threads.
#pragma once

#include <condition_variable>
#include <map>
#include <mutex>

#include "cohort/core/store/store.h"

namespace cohort {

class HashStore : public Store {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

}  // namespace cohort
