// --backend mpi hands the job to mpirun. A stand-in mpirun on PATH records
// the command line it was given, or writes tagged output, so no MPI
// installation is needed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "support/subprocess.h"

namespace cohort::testing::mpirun_test {
namespace {

class Mpirun : public ::testing::Test {
 protected:
  void SetUp() override {
    write_file(bin_.path() + "/mpirun", "#!/bin/sh\nprintf '<%s>' \"$@\"; echo; exit 7\n",
               /*executable=*/true);
    const char* path = std::getenv("PATH");
    path_ = "PATH=" + bin_.path() + ":" + (path ? path : "/usr/bin:/bin");
  }

  std::string expected_flags(int n) const {
    std::string flags;
    if (::geteuid() == 0) flags += "<--allow-run-as-root>";
    if (n > ::sysconf(_SC_NPROCESSORS_ONLN)) flags += "<--oversubscribe>";
    // A single-node job stays on loopback.
    flags += "<--mca><btl_tcp_if_include><lo>";
    flags += "<--tag-output>";  // the launcher turns the tags into "[rank] "
    return flags;
  }

  TempDir bin_;
  std::string path_;
};

TEST_F(Mpirun, RunsMpirunWithTheProgram) {
  ProcessResult r =
      run_cohortrun({"-n", "1", "--backend", "mpi", "--", "prog", "a", "-b"}, Seconds(20), {path_});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 7) << r.err;  // mpirun's exit code is the job's
  EXPECT_EQ(r.out, "<-np><1>" + expected_flags(1) +
                       "<-x><COHORT_BACKEND=mpi><-x><COHORT_PROGRESS=lines><prog><a><-b>\n");
}

TEST_F(Mpirun, OversubscribesOnlyPastTheCoreCount) {
  const int n = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)) + 1;
  ProcessResult r = run_cohortrun({"-n", std::to_string(n), "--backend", "mpi", "--", "prog"},
                                  Seconds(20), {path_});
  ASSERT_FALSE(r.timed_out);
  EXPECT_NE(r.out.find("<--oversubscribe>"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.rfind("<-np><" + std::to_string(n) + ">" + expected_flags(n), 0), 0u) << r.out;
}

// What Open MPI's --tag-output writes, partial lines included: a piece
// without its newline is followed by the next piece's tag mid-line. Each
// rank's lines come out whole with the Gloo path's "[rank] " prefix, on the
// stream they were written to; mpirun's own lines pass unchanged.
TEST_F(Mpirun, TaggedLinesGetTheRankPrefix) {
  write_file(bin_.path() + "/mpirun",
             "#!/bin/sh\n"
             "printf '[1,0]<stdout>:hi 0\\n[1,0]<stdout>:part[1,1]<stdout>:hi 1\\n'\n"
             "printf '[1,1]<stdout>:[x] [2,3] ok\\n[1,0]'\n"
             "sleep 0.2\n"  // a tag cut in two by the pipe
             "printf '<stdout>:ial\\n[1,1]<stdout>:no newline'\n"
             "printf '[1,1]<stderr>:err 1\\nmpirun noticed a thing\\n' >&2\n"
             "exit 5\n",
             /*executable=*/true);
  ProcessResult r =
      run_cohortrun({"-n", "2", "--backend", "mpi", "--", "prog"}, Seconds(20), {path_});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_EQ(r.out, "[0] hi 0\n[1] hi 1\n[1] [x] [2,3] ok\n[0] partial\n[1] no newline\n");
  EXPECT_EQ(r.err, "[1] err 1\nmpirun noticed a thing\n");
}

TEST_F(Mpirun, MissingMpirunGives127) {
  ProcessResult r = run_cohortrun({"-n", "2", "--backend", "mpi", "--", "prog"}, Seconds(20),
                                  {"PATH=" + bin_.path() + "/empty"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.err.find("cannot exec mpirun"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing::mpirun_test
