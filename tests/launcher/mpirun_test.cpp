// --backend mpi hands the job to mpirun. A stand-in mpirun on PATH records
// the command line it was given, so no MPI installation is needed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "support/subprocess.h"

namespace cohort::testing {
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
    flags += "<--mca><oob_tcp_if_include><lo><--mca><btl_tcp_if_include><lo>";
    return flags;
  }

  TempDir bin_;
  std::string path_;
};

TEST_F(Mpirun, ExecsMpirunWithTheProgram) {
  ProcessResult r =
      run_cohortrun({"-n", "1", "--backend", "mpi", "--", "prog", "a", "-b"}, Seconds(20), {path_});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 7) << r.err;  // mpirun's own: the launcher is gone
  EXPECT_EQ(r.out, "<-np><1>" + expected_flags(1) + "<-x><COHORT_BACKEND=mpi><prog><a><-b>\n");
}

TEST_F(Mpirun, OversubscribesOnlyPastTheCoreCount) {
  const int n = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)) + 1;
  ProcessResult r = run_cohortrun({"-n", std::to_string(n), "--backend", "mpi", "--", "prog"},
                                  Seconds(20), {path_});
  ASSERT_FALSE(r.timed_out);
  EXPECT_NE(r.out.find("<--oversubscribe>"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.rfind("<-np><" + std::to_string(n) + ">" + expected_flags(n), 0), 0u) << r.out;
}

TEST_F(Mpirun, MissingMpirunGives127) {
  ProcessResult r = run_cohortrun({"-n", "2", "--backend", "mpi", "--", "prog"}, Seconds(20),
                                  {"PATH=" + bin_.path() + "/empty"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.err.find("cannot exec mpirun"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing
