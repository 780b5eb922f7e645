// defines: Store, the key-value rendezvous every group is built on.
//
// Ranks exchange addresses and small agreements (subgroup membership, debug
// fingerprints) through a Store. Implementations: HashStore (in-process, for
// ranks as threads), TcpStore (torchrun's MASTER_ADDR:MASTER_PORT), FileStore
// (file:// rendezvous, through c10d), PrefixStore (a subgroup's key space).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Waits up to timeout() for `key` to exist, then returns its value.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer at `key` (0 if absent); returns
  // the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists; does not wait.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists; throws TimeoutError naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  virtual bool delete_key(const std::string& key) = 0;

  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

  // Convenience for strings.
  void set_string(const std::string& key, const std::string& value);
  std::string get_string(const std::string& key);

 protected:
  Millis timeout_{std::chrono::minutes(30)};
};

}  // namespace cohort
