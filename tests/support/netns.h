// defines: VethNamespaces — two network namespaces joined by a veth pair,
// standing in for two nodes; BridgedNamespaces — any number of them on one
// bridge; find_program.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace cohort::testing {

// The full path of `name` on PATH, or "" when absent.
std::string find_program(const std::string& name);

// Namespace i (0 or 1) has 10.77.0.(i+1)/24 on its end of the veth pair,
// and lo up. Names carry the test's pid, so concurrent runs do not collide.
class VethNamespaces {
 public:
  // Returns null with the reason in *why when the namespaces cannot be
  // made (not root, no ip tool, no permission in this container).
  static std::unique_ptr<VethNamespaces> create(std::string* why);
  VethNamespaces(const VethNamespaces&) = delete;
  VethNamespaces& operator=(const VethNamespaces&) = delete;
  // Deletes both namespaces; the veth pair goes with them.
  ~VethNamespaces();

  const std::string& ip() const { return ip_; }
  const std::string& name(int i) const { return names_[i]; }
  static std::string address(int i) { return "10.77.0." + std::to_string(i + 1); }

 private:
  explicit VethNamespaces(std::string ip);
  bool set_up(std::string* why);
  void tear_down();
  // Removes what earlier runs that died mid-test left behind.
  void remove_stale();

  std::string ip_;
  std::string names_[2];
  std::string veths_[2];
};

// N namespaces standing in for N nodes on one network: namespace 0 holds a
// bridge with 10.77.0.1/24; namespace i > 0 reaches it through a veth pair
// and has 10.77.0.(i+1)/24. All have lo up.
class BridgedNamespaces {
 public:
  // Null with the reason in *why when the namespaces cannot be made.
  static std::unique_ptr<BridgedNamespaces> create(int count, std::string* why);
  BridgedNamespaces(const BridgedNamespaces&) = delete;
  BridgedNamespaces& operator=(const BridgedNamespaces&) = delete;
  ~BridgedNamespaces();  // deletes the namespaces; their veths go with them

  const std::string& ip() const { return ip_; }
  const std::string& name(int i) const { return names_.at(i); }
  static std::string address(int i) { return "10.77.0." + std::to_string(i + 1); }
  // argv that runs `command` in namespace i.
  std::vector<std::string> exec_in(int i, const std::vector<std::string>& command) const;

 private:
  BridgedNamespaces(std::string ip, int count);
  bool set_up(std::string* why);

  std::string ip_;
  std::vector<std::string> names_;
};

}  // namespace cohort::testing
