#include "cohort/observability/comm_stats.h"

#include <sstream>

namespace cohort {
namespace {

constexpr const char* kNames[kOpKindCount] = {"all_reduce",
                                              "all_reduce_coalesced",
                                              "broadcast",
                                              "broadcast_coalesced",
                                              "reduce",
                                              "all_gather",
                                              "all_gather_into_tensor",
                                              "reduce_scatter",
                                              "reduce_scatter_tensor",
                                              "gather",
                                              "scatter",
                                              "all_to_all",
                                              "all_to_all_single",
                                              "barrier",
                                              "send",
                                              "recv",
                                              "calibration",
                                              "other"};

}  // namespace

const char* to_string(OpKind kind) { return kNames[static_cast<size_t>(kind)]; }

OpKind op_kind_from_name(const std::string& op) {
  for (size_t i = 0; i < kOpKindCount; ++i) {
    if (op == kNames[i]) return static_cast<OpKind>(i);
  }
  return OpKind::Other;
}

OpStats& OpStats::operator+=(const OpStats& o) {
  calls += o.calls;
  completed += o.completed;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  seconds_in_flight += o.seconds_in_flight;
  seconds_waiting += o.seconds_waiting;
  return *this;
}

OpStats CommStats::total() const {
  OpStats t;
  for (auto& o : ops) t += o;
  return t;
}

CommStats CommStats::since(const CommStats& e) const {
  // Across a reset a difference would wrap below zero: what was counted
  // since it. bytes_sent_ever alone counts on through resets.
  CommStats d = *this;
  d.bytes_sent_ever = bytes_sent_ever - e.bytes_sent_ever;
  if (resets != e.resets) return d;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    auto& a = ops[i];
    auto& b = e.ops[i];
    d.ops[i] = {a.calls - b.calls,
                a.completed - b.completed,
                a.bytes_sent - b.bytes_sent,
                a.bytes_received - b.bytes_received,
                a.seconds_in_flight - b.seconds_in_flight,
                a.seconds_waiting - b.seconds_waiting};
  }
  return d;
}

std::string CommStats::to_string() const {
  std::ostringstream os;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    auto& o = ops[i];
    if (o.calls == 0 && o.bytes_sent == 0 && o.bytes_received == 0) continue;
    os << kNames[i] << " calls=" << o.calls << " sent=" << o.bytes_sent
       << " received=" << o.bytes_received << " in_flight_s=" << o.seconds_in_flight
       << " waiting_s=" << o.seconds_waiting << "\n";
  }
  return os.str();
}

}  // namespace cohort
