// Runs the rank program named by the link this executable was started
// through (programs.h).
#include <cstdio>
#include <cstring>

#include "comm/programs/programs.h"

namespace {

using Program = int (*)(int, char**);
namespace p = cohort::testing::programs;

struct Entry {
  const char* name;
  Program run;
};
constexpr Entry kPrograms[] = {
    {"dead_peer", p::dead_peer},         {"dead_transfer", p::dead_transfer},
    {"fd_limit", p::fd_limit},           {"init_loop", p::init_loop},
    {"out_of_memory", p::out_of_memory}, {"stopped_peer", p::stopped_peer},
};

}  // namespace

int main(int argc, char** argv) {
  const char* slash = std::strrchr(argv[0], '/');
  const char* name = slash ? slash + 1 : argv[0];
  for (const Entry& e : kPrograms)
    if (std::strcmp(name, e.name) == 0) return e.run(argc, argv);
  std::fprintf(stderr, "rank_programs: started as '%s', which names no program:", name);
  for (const Entry& e : kPrograms) std::fprintf(stderr, " %s", e.name);
  std::fprintf(stderr, "\n");
  return 2;
}
