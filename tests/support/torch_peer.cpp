#include "support/torch_peer.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <stdexcept>

#include "support/subprocess.h"

namespace cohort::testing {

void write_raw(const std::string& path, const torch::Tensor& t) {
  auto c = t.contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), c.nbytes());
  if (!f.good()) throw std::runtime_error("write_raw: cannot write " + path);
}

torch::Tensor read_raw(const std::string& path, const torch::Tensor& like) {
  std::ifstream f(path, std::ios::binary);
  auto out = torch::empty_like(like).contiguous();
  f.read(static_cast<char*>(out.data_ptr()), out.nbytes());
  if (!f.good() || f.gcount() != static_cast<std::streamsize>(out.nbytes()))
    throw std::runtime_error("read_raw: " + path + " is missing or shorter than " +
                             std::to_string(out.nbytes()) + " bytes");
  return out;
}

torch::Tensor read_raw(const std::string& path, at::IntArrayRef shape) {
  return read_raw(path, torch::empty(shape));
}

int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::optional<std::string> probe_torch_peer(const std::string& script) {
  auto r =
      run_process({kTorchPython, script, "--probe"}, Seconds(60), {"PYTHONDONTWRITEBYTECODE=1"});
  if (r.exit_code == 0) return std::nullopt;
  if (r.exit_code == 77) return r.out;
  throw std::runtime_error(script + " --probe exited " + std::to_string(r.exit_code) + ":\n" +
                           r.out + r.err);
}

std::string run_torch_peers(const std::string& script, const std::vector<std::string>& args,
                            int world, double limit_s) {
  const std::string port = std::to_string(free_loopback_port());
  std::vector<std::string> argv{kTorchPython, script};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(std::make_unique<Subprocess>(
        argv, std::vector<std::string>{
                  "RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                  "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, "OMP_NUM_THREADS=1",
                  "OPENBLAS_NUM_THREADS=1", "PYTHONDONTWRITEBYTECODE=1"}));
  const auto deadline = Clock::now() + Seconds(limit_s);
  std::string failures;
  for (int r = 0; r < world; ++r) {
    // One deadline for the job: a rank waiting on a dead peer is killed
    // when it passes, not `world` limits later.
    auto left = std::max(Seconds(deadline - Clock::now()), Seconds(1));
    auto res = ranks[r]->finish(left);
    if (res.exit_code != 0 || res.timed_out)
      failures += "rank " + std::to_string(r) + " exited " + std::to_string(res.exit_code) +
                  (res.timed_out ? " (killed after the time limit)" : "") + ":\n" + res.out +
                  res.err + "\n";
  }
  return failures;
}

void expect_golden(double diff, double control, double tolerance, const std::string& what) {
  std::cout << what << ": max |cohort - PyTorch| " << diff << ", against the negative control "
            << control << " (tolerance " << tolerance << ")\n";
  EXPECT_LE(diff, tolerance) << what << ": cohort differs from PyTorch";
  EXPECT_GT(control, tolerance) << what << ": the check accepts the perturbed reference";
}

}  // namespace cohort::testing
