#include "cohort/core/store/store.h"

namespace cohort {

void Store::set_string(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Store::get_string(const std::string& key) {
  auto v = get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace cohort
