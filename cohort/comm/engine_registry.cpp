#include "cohort/comm/engine_registry.h"

#include "cohort/comm/error.h"
#include "cohort/comm/gloo/c10d_adapter.h"

namespace cohort {

std::vector<std::string> available_backends() { return {"gloo"}; }

std::unique_ptr<Engine> create_engine(std::shared_ptr<Store> store, int rank, int size,
                                      const ConnectOptions& options) {
  if (options.backend == "gloo") {
    GlooOptions g;
    g.bind_address = options.bind_address;
    g.interface = options.interface;
    g.timeout = options.timeout;
    return make_gloo_engine(std::move(store), rank, size, g);
  }
  std::string known;
  for (auto& b : available_backends()) known += (known.empty() ? "" : ", ") + b;
  throw ConfigError("cohort: backend '" + options.backend +
                    "' is not available in this build (available: " + known + ")");
}

}  // namespace cohort
