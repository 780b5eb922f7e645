// defines: make_ucx_engine, the UCX engine's one door (no UCX type here, so
// the registry and the rest of cohort never include ucp.h).
#pragma once

#include <memory>
#include <string>

#include "cohort/core/engine.h"
#include "cohort/core/store/store.h"

namespace cohort {

/// Connects `size` ranks through `store` over UCX (a collective call: every rank calls it with
/// the same store). On one host UCX uses shared memory only; across hosts, its network transports
/// on `interface`, else on the interface that carries `bind_address`. Throws TimeoutError naming
/// the missing ranks, ConfigError when UCX cannot start.
std::unique_ptr<Engine> make_ucx_engine(std::shared_ptr<Store> store, int rank, int size,
                                        const std::string& bind_address,
                                        const std::string& interface, Millis timeout);

}  // namespace cohort
