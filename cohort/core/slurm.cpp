#include "cohort/core/slurm.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "cohort/core/error.h"

namespace cohort::slurm {
namespace {

constexpr size_t kMaxHosts = 65536;

[[noreturn]] void bad_list(const std::string& list, const std::string& why) {
  throw ConfigError("cohort: Slurm node list '" + list + "' is malformed: " + why);
}

bool host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

unsigned long long parse_bound(const std::string& list, const std::string& text) {
  if (text.empty() || text.size() > 18) bad_list(list, "range bound '" + text + "'");
  for (char c : text) {
    if (c < '0' || c > '9') bad_list(list, "range bound '" + text + "' is not a number");
  }
  return std::stoull(text);
}

// "01-03,07" -> 01 02 03 07: each number as wide as its range's first
// bound, as Slurm writes them.
std::vector<std::string> expand_ranges(const std::string& list, const std::string& ranges) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t end = ranges.find(',', start);
    if (end == std::string::npos) end = ranges.size();
    const std::string range = ranges.substr(start, end - start);
    const size_t dash = range.find('-');
    const std::string lo_text = range.substr(0, dash);
    const auto lo = parse_bound(list, lo_text);
    const auto hi = dash == std::string::npos ? lo : parse_bound(list, range.substr(dash + 1));
    if (hi < lo) bad_list(list, "range '" + range + "' descends");
    if (hi - lo >= kMaxHosts) bad_list(list, "more than " + std::to_string(kMaxHosts) + " hosts");
    for (auto v = lo; v <= hi; ++v) {
      std::string digits = std::to_string(v);
      if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
      out.push_back(std::move(digits));
    }
    start = end + 1;
  }
  return out;
}

// One comma-free group, "n[1-2]-ib[3-4]" included: the first bracket's
// numbers, each followed by every expansion of the rest.
void expand_group(const std::string& list, const std::string& group,
                  std::vector<std::string>& hosts) {
  const size_t open = group.find('[');
  if (open == std::string::npos) {
    hosts.push_back(group);
    return;
  }
  const size_t close = group.find(']', open);
  const std::string prefix = group.substr(0, open);
  std::vector<std::string> tails;
  expand_group(list, group.substr(close + 1), tails);
  for (const auto& number : expand_ranges(list, group.substr(open + 1, close - open - 1))) {
    for (const auto& tail : tails) {
      if (hosts.size() >= kMaxHosts) {
        bad_list(list, "more than " + std::to_string(kMaxHosts) + " hosts");
      }
      hosts.push_back(prefix + number + tail);
    }
  }
}

int parse_int(const Lookup& env, const char* name, long long lo, long long hi) {
  const auto text = env(name);
  if (!text) throw ConfigError(std::string("cohort: Slurm job step without ") + name);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text->c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE || v < lo || v > hi) {
    throw ConfigError(std::string("cohort: environment variable ") + name + "='" + *text +
                      "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                      "]");
  }
  return static_cast<int>(v);
}

unsigned long long parse_id(const Lookup& env, const char* name) {
  const auto text = env(name);
  if (!text) throw ConfigError(std::string("cohort: Slurm job step without ") + name);
  char* end = nullptr;
  errno = 0;
  const auto v = std::strtoull(text->c_str(), &end, 10);
  if ((*text)[0] == '-' || *end != '\0' || errno == ERANGE) {
    throw ConfigError(std::string("cohort: environment variable ") + name + "='" + *text +
                      "' is not a Slurm id");
  }
  return v;
}

// Slurm's own steps (the batch script, the extern step, an interactive
// shell) have ids above its last normal one (0xfffffff0), which Slurm 26
// puts in SLURM_STEP_ID as signed 32-bit numbers (the batch script's is
// -5). None of them is a step srun started.
bool special_step(const std::string& id) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(id.c_str(), &end, 10);
  if (end == id.c_str() || *end != '\0' || errno == ERANGE) return false;  // parse_id names it
  const long long as_unsigned = v < 0 ? v + (1LL << 32) : v;
  return as_unsigned > 0xfffffff0LL;
}

// Whether this task serves the store (s.serves_store), else s.master_unknown.
// The store is on the step's first node, which every task reads alike, and
// is served by that node's first task, wherever task 0 runs: the layout
// (block, cyclic, plane, arbitrary, or one a topology plugin ordered) need
// not be known. Every node of a step runs a task, so exactly one serves.
void find_server(const Lookup& env, const char* list_name, Step& s) {
  std::string why;
  std::string node;  // this task's node: slurmd's name for it, as node lists spell it
  if (std::strcmp(list_name, "SLURM_STEP_NODELIST") != 0) {
    why = "SLURM_STEP_NODELIST is unset, and the job's first node need not run a task of it";
  } else if (!env("SLURM_LOCALID")) {
    why = "SLURM_LOCALID is unset, which says which task of the first node serves the store";
  } else if (const auto name = env("SLURMD_NODENAME")) {
    node = *name;
  } else if (env("SLURM_NODEID")) {
    const int id = parse_int(env, "SLURM_NODEID", 0, static_cast<int>(s.hosts.size()) - 1);
    node = s.hosts[static_cast<size_t>(id)];
  } else {
    why = "SLURMD_NODENAME and SLURM_NODEID are unset, which say whether this task runs on " +
          s.hosts.front();
  }
  if (why.empty() && std::find(s.hosts.begin(), s.hosts.end(), node) == s.hosts.end()) {
    why = "this task's node " + node + " is not in SLURM_STEP_NODELIST (a heterogeneous step?)";
  }
  if (why.empty()) {
    s.serves_store = node == s.hosts.front() && s.local_rank == 0;
  } else {
    s.master_unknown = "cohort: Slurm job step on " + std::to_string(s.hosts.size()) +
                       " nodes: " + why +
                       "; set MASTER_ADDR to the host of task 0 (SLURM_PROCID=0)";
  }
}

}  // namespace

std::vector<std::string> expand_nodelist(const std::string& list) {
  if (list.empty()) bad_list(list, "it is empty");
  // Split at the commas outside brackets, checking the brackets on the way.
  std::vector<std::string> groups(1);
  bool inside = false;
  for (char c : list) {
    if (c == '[') {
      if (inside) bad_list(list, "nested '['");
      inside = true;
    } else if (c == ']') {
      if (!inside) bad_list(list, "']' without '['");
      if (groups.back().back() == '[') bad_list(list, "empty brackets");
      inside = false;
    } else if (c == ',' && !inside) {
      if (groups.back().empty()) bad_list(list, "an empty host name");
      groups.emplace_back();
      continue;
    } else if (!host_char(c) && !(inside && c == ',')) {
      bad_list(list, std::string("character '") + c + "'");
    }
    groups.back() += c;
  }
  if (inside) bad_list(list, "'[' without ']'");
  if (groups.back().empty()) bad_list(list, "an empty host name");
  std::vector<std::string> hosts;
  for (const auto& g : groups) expand_group(list, g, hosts);
  return hosts;
}

int default_port(unsigned long long job_id, unsigned long long step_id) {
  return static_cast<int>(20000 + 10 * (job_id % 1000) + step_id % 10);
}

std::optional<std::string> from_environment(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::optional<Step> job_step(const Lookup& env) {
  const auto id = env("SLURM_STEP_ID");
  if (!id || special_step(*id)) return std::nullopt;
  Step s;
  const char* size_name = env("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  s.size = parse_int(env, size_name, 1, 1 << 20);
  s.rank = parse_int(env, "SLURM_PROCID", 0, 1 << 20);
  if (s.rank >= s.size) {
    throw ConfigError("cohort: SLURM_PROCID=" + std::to_string(s.rank) + " is not below " +
                      size_name + "=" + std::to_string(s.size));
  }
  if (env("SLURM_LOCALID")) s.local_rank = parse_int(env, "SLURM_LOCALID", 0, s.size - 1);
  const char* list_name = env("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  const auto list = env(list_name);
  if (!list) throw ConfigError("cohort: Slurm job step without SLURM_STEP_NODELIST");
  s.hosts = expand_nodelist(*list);
  if (auto addr = env("MASTER_ADDR")) {
    s.master_addr = *addr;
    s.serves_store = s.rank == 0;
  } else if (s.hosts.size() == 1) {
    // One host: the store and the transports stay on loopback.
    s.master_addr = "127.0.0.1";
    s.serves_store = s.rank == 0;
  } else {
    s.master_addr = s.hosts.front();
    find_server(env, list_name, s);
  }
  s.master_port = env("MASTER_PORT")
                      ? parse_int(env, "MASTER_PORT", 1, 65535)
                      : default_port(parse_id(env, "SLURM_JOB_ID"), parse_id(env, "SLURM_STEP_ID"));
  return s;
}

}  // namespace cohort::slurm
