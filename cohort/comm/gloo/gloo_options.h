// defines: GlooOptions, where the Gloo engine's transport listens (a
// ConnectOptions field, so public; the engine itself is c10d_adapter.h's).
#pragma once

#include <string>

namespace cohort {

/// Where Gloo's transport listens (the timeout is the communicator's).
struct GlooOptions {
  /// Address Gloo's transport binds to: 127.0.0.1 for single-host jobs, the
  /// interface that reaches the other hosts otherwise.
  std::string bind_address = "127.0.0.1";
  /// Network interface to bind instead of an address (GLOO_SOCKET_IFNAME).
  std::string interface;
  /// Gloo worker threads per group; operations of one group run in order.
  int threads = 2;
};

}  // namespace cohort
