// defines: pick_free_port, StoreListener, listen_on_free_port,
// loopback_port_free — ports for one-node jobs. All bind 127.0.0.1 only:
// probing must not open a port to the network, even for an instant.
#pragma once

#include "fd.h"

namespace cohortrun {

// A port the kernel reports free on 127.0.0.1. The probe socket is closed
// before rank 0 binds, so another process could take the port in between;
// that fails the attempt, and a restart picks another port.
int pick_free_port();

// A socket listening on 127.0.0.1 at a port the kernel picked, close-on-exec.
// Rank 0 inherits it (COHORT_STORE_FD) and serves the store on it, so no
// other process can take the port between the pick and rank 0's start.
struct StoreListener {
  UniqueFd fd;
  int port = 0;
};
StoreListener listen_on_free_port();

// Whether 127.0.0.1:port can be bound now. The probe sets SO_REUSEADDR so
// that connections lingering in TIME_WAIT from an earlier run do not count
// as "in use" (rank 0's store sets it too); a listener or any other bound
// socket still does.
bool loopback_port_free(int port);

}  // namespace cohortrun
