// The rank programs the process tests start, built as one executable
// (rank_programs: one compile of LibTorch's templates instead of one per
// program). Each program's name is a link to it in the build folder, and
// main() runs the program whose name it was started by.
#pragma once

namespace cohort::testing::programs {

namespace dead_peer {
int run(int argc, char** argv);
}
namespace dead_transfer {
int run(int argc, char** argv);
}
namespace fd_limit {
int run(int argc, char** argv);
}
namespace init_loop {
int run(int argc, char** argv);
}
namespace out_of_memory {
int run(int argc, char** argv);
}
namespace stopped_peer {
int run(int argc, char** argv);
}

}  // namespace cohort::testing::programs
