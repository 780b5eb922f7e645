#include "support/netns.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <vector>

#include "support/subprocess.h"

namespace cohort::testing {
namespace {

constexpr const char* kNamespacePrefix = "cohortrun_test_";
constexpr const char* kVethPrefix = "crv";  // interface names: 15 chars max

// The pid embedded in "<prefix><pid>_a" or "<prefix><pid>a", or -1.
pid_t pid_in(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return -1;
  size_t end = name.find_first_not_of("0123456789", prefix.size());
  if (end == prefix.size()) return -1;
  return std::atoi(name.substr(prefix.size(), end - prefix.size()).c_str());
}

bool is_stale(pid_t pid) { return pid > 0 && (pid == ::getpid() || !process_running(pid)); }

// Runs `ip` with each step's arguments in turn; false, saying which failed
// and why, at the first that does.
bool run_ip_steps(const std::string& ip, const std::vector<std::vector<std::string>>& steps,
                  std::string* why) {
  for (const auto& step : steps) {
    std::vector<std::string> argv = {ip};
    argv.insert(argv.end(), step.begin(), step.end());
    ProcessResult r = run_process(argv, Seconds(10));
    if (r.exit_code != 0) {
      std::string command;
      for (const std::string& a : argv) command += " " + a;
      *why = "'" + command.substr(1) + "' failed: " + r.err;
      return false;
    }
  }
  return true;
}

}  // namespace

std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = std::string(path ? path : "") + ":/usr/sbin:/sbin";
  std::istringstream in(dirs);
  for (std::string dir; std::getline(in, dir, ':');) {
    std::string candidate = dir + "/" + name;
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

VethNamespaces::VethNamespaces(std::string ip) : ip_(std::move(ip)) {
  const std::string pid = std::to_string(::getpid());
  names_[0] = kNamespacePrefix + pid + "_a";
  names_[1] = kNamespacePrefix + pid + "_b";
  veths_[0] = kVethPrefix + pid + "a";
  veths_[1] = kVethPrefix + pid + "b";
}

std::unique_ptr<VethNamespaces> VethNamespaces::create(std::string* why) {
  if (::geteuid() != 0) {
    *why = "creating network namespaces needs root";
    return nullptr;
  }
  std::string ip = find_program("ip");
  if (ip.empty()) {
    *why = "the iproute2 'ip' tool is not installed";
    return nullptr;
  }
  std::unique_ptr<VethNamespaces> ns(new VethNamespaces(ip));
  ns->remove_stale();
  if (!ns->set_up(why)) return nullptr;  // the destructor cleans up
  return ns;
}

VethNamespaces::~VethNamespaces() { tear_down(); }

bool VethNamespaces::set_up(std::string* why) {
  const std::vector<std::vector<std::string>> steps = {
      {"netns", "add", names_[0]},
      {"netns", "add", names_[1]},
      {"link", "add", veths_[0], "type", "veth", "peer", "name", veths_[1]},
      {"link", "set", veths_[0], "netns", names_[0]},
      {"link", "set", veths_[1], "netns", names_[1]},
      {"-n", names_[0], "addr", "add", address(0) + "/24", "dev", veths_[0]},
      {"-n", names_[1], "addr", "add", address(1) + "/24", "dev", veths_[1]},
      {"-n", names_[0], "link", "set", veths_[0], "up"},
      {"-n", names_[1], "link", "set", veths_[1], "up"},
      {"-n", names_[0], "link", "set", "lo", "up"},
      {"-n", names_[1], "link", "set", "lo", "up"},
  };
  return run_ip_steps(ip_, steps, why);
}

void VethNamespaces::tear_down() {
  for (const std::string& name : names_) {
    run_process({ip_, "netns", "delete", name}, Seconds(10));
  }
  // Only left in the root namespace if setup stopped before moving it.
  run_process({ip_, "link", "delete", veths_[0]}, Seconds(10));
}

void VethNamespaces::remove_stale() {
  tear_down();  // same names as ours: a previous process with our pid
  ProcessResult list = run_process({ip_, "netns", "list"}, Seconds(10));
  for (const std::string& line : lines_of(list.out)) {
    std::string name = line.substr(0, line.find(' '));
    if (is_stale(pid_in(name, kNamespacePrefix))) {
      run_process({ip_, "netns", "delete", name}, Seconds(10));
    }
  }
  // "7: crv123a@crv123b: <...>": the name ends at '@' or ':'.
  ProcessResult links = run_process({ip_, "-o", "link", "show"}, Seconds(10));
  for (const std::string& line : lines_of(links.out)) {
    size_t start = line.find(": ");
    if (start == std::string::npos) continue;
    std::string name = line.substr(start + 2);
    name = name.substr(0, name.find_first_of("@:"));
    if (is_stale(pid_in(name, kVethPrefix))) {
      run_process({ip_, "link", "delete", name}, Seconds(10));
    }
  }
}

BridgedNamespaces::BridgedNamespaces(std::string ip, int count) : ip_(std::move(ip)) {
  // Named as VethNamespaces' are, so that its stale-run cleanup covers them.
  const std::string pid = std::to_string(::getpid());
  for (int i = 0; i < count; ++i)
    names_.push_back(kNamespacePrefix + pid + "_n" + std::to_string(i));
}

std::unique_ptr<BridgedNamespaces> BridgedNamespaces::create(int count, std::string* why) {
  if (::geteuid() != 0) {
    *why = "creating network namespaces needs root";
    return nullptr;
  }
  std::string ip = find_program("ip");
  if (ip.empty()) {
    *why = "the iproute2 'ip' tool is not installed";
    return nullptr;
  }
  std::unique_ptr<BridgedNamespaces> ns(new BridgedNamespaces(ip, count));
  // Same names as ours: left by an earlier process with our pid.
  for (const std::string& name : ns->names_)
    run_process({ip, "netns", "delete", name}, Seconds(10));
  if (!ns->set_up(why)) return nullptr;  // the destructor cleans up
  return ns;
}

bool BridgedNamespaces::set_up(std::string* why) {
  const std::string pid = std::to_string(::getpid());
  std::vector<std::vector<std::string>> steps;
  for (const std::string& name : names_) steps.push_back({"netns", "add", name});
  steps.push_back({"-n", names_[0], "link", "add", "br0", "type", "bridge"});
  steps.push_back({"-n", names_[0], "addr", "add", address(0) + "/24", "dev", "br0"});
  steps.push_back({"-n", names_[0], "link", "set", "br0", "up"});
  steps.push_back({"-n", names_[0], "link", "set", "lo", "up"});
  for (size_t i = 1; i < names_.size(); ++i) {
    const std::string node = kVethPrefix + pid + "n" + std::to_string(i);
    const std::string port = kVethPrefix + pid + "b" + std::to_string(i);
    const std::string& ns = names_[i];
    steps.push_back({"link", "add", node, "type", "veth", "peer", "name", port});
    steps.push_back({"link", "set", port, "netns", names_[0]});
    steps.push_back({"link", "set", node, "netns", ns});
    steps.push_back({"-n", names_[0], "link", "set", port, "master", "br0"});
    steps.push_back({"-n", names_[0], "link", "set", port, "up"});
    steps.push_back({"-n", ns, "addr", "add", address(static_cast<int>(i)) + "/24", "dev", node});
    steps.push_back({"-n", ns, "link", "set", node, "up"});
    steps.push_back({"-n", ns, "link", "set", "lo", "up"});
  }
  return run_ip_steps(ip_, steps, why);
}

BridgedNamespaces::~BridgedNamespaces() {
  for (const std::string& name : names_) run_process({ip_, "netns", "delete", name}, Seconds(10));
}

std::vector<std::string> BridgedNamespaces::exec_in(int i,
                                                    const std::vector<std::string>& command) const {
  std::vector<std::string> argv = {ip_, "netns", "exec", names_.at(i)};
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

}  // namespace cohort::testing
