// The rank programs the process tests start, built as one executable
// (rank_programs: one compile of LibTorch's templates instead of one per
// program). Each program's name is a link to it in the build folder, and
// main() runs the program whose name it was started by.
#pragma once

namespace cohort::testing::programs {

int dead_peer(int argc, char** argv);
int dead_transfer(int argc, char** argv);
int fd_limit(int argc, char** argv);
int init_loop(int argc, char** argv);
int out_of_memory(int argc, char** argv);
int stopped_peer(int argc, char** argv);

}  // namespace cohort::testing::programs
