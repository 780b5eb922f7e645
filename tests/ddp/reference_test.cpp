// Golden test against PyTorch's own DistributedDataParallel: the same
// model, initial weights and data trained by tests/reference/ddp_reference.py
// (two gloo processes started here with RANK/WORLD_SIZE/MASTER_* set) and by
// cohort (two ranks as threads). Each rank's per-step losses and the final
// parameters and buffers must match within 1e-5, for an MLP and for a CNN
// with BatchNorm (whose buffers DDP re-broadcasts before every forward).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing {
namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 20;
constexpr int kRows = 8;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;

torch::nn::Sequential make_model(const std::string& kind) {
  using namespace torch::nn;
  if (kind == "mlp") return Sequential(Linear(20, 32), ReLU(), Linear(32, 10));
  return Sequential(Conv2d(Conv2dOptions(1, 4, 3)), BatchNorm2d(4), ReLU(), MaxPool2d(2),
                    Flatten(), Linear(36, 10));
}

std::vector<int64_t> input_shape(const std::string& kind) {
  return kind == "mlp" ? std::vector<int64_t>{20} : std::vector<int64_t>{1, 8, 8};
}

void write_raw(const std::string& path, const torch::Tensor& t) {
  auto c = t.contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), c.nbytes());
  ASSERT_TRUE(f.good()) << path;
}

torch::Tensor read_raw(const std::string& path, const torch::Tensor& like) {
  std::ifstream f(path, std::ios::binary);
  auto out = torch::empty_like(like).contiguous();
  f.read(static_cast<char*>(out.data_ptr()), out.nbytes());
  EXPECT_TRUE(f.good() && f.gcount() == static_cast<std::streamsize>(out.nbytes())) << path;
  return out;
}

int free_port() {
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

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class PyTorchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(PyTorchReference, LossesAndParametersMatchPyTorchDdp) {
  const std::string kind = GetParam();
  torch::set_num_threads(1);
  char tmpl[] = "/tmp/cohort_ddp_ref_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;

  torch::manual_seed(21);
  auto init_model = make_model(kind);
  const auto init = clone_all(init_model->parameters());
  for (size_t i = 0; i < init.size(); ++i) write_raw(dir + "/init_" + std::to_string(i) + ".bin", init[i]);
  std::vector<int64_t> xshape{kSteps, kWorld * kRows};
  for (auto d : input_shape(kind)) xshape.push_back(d);
  const auto x = torch::randn(xshape);
  const auto y = torch::randint(0, 10, {kSteps, kWorld * kRows}, torch::kLong);
  write_raw(dir + "/x.bin", x);
  write_raw(dir + "/y.bin", y);

  // Two PyTorch processes; `timeout` bounds the whole run so it cannot hang.
  std::ostringstream cmd;
  const std::string args = std::string(" ") + DDP_REFERENCE_SCRIPT + " --model " + kind + " --dir " + dir +
                           " --steps " + std::to_string(kSteps) + " --rows " + std::to_string(kRows) +
                           " --lr " + std::to_string(kLr) + " --momentum " + std::to_string(kMomentum);
  const std::string env = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ";
  cmd << "timeout 100 sh -c '" << "RANK=0 " << env << DDP_REFERENCE_PYTHON << args << " > " << dir
      << "/log0 2>&1 & a=$!; RANK=1 " << env << DDP_REFERENCE_PYTHON << args << " > " << dir
      << "/log1 2>&1 & b=$!; wait $a; ra=$?; wait $b; rb=$?; exit $((ra | rb))'";
  const int rc = std::system(cmd.str().c_str());
  ASSERT_EQ(rc, 0) << cmd.str() << "\nrank 0:\n" << slurp(dir + "/log0") << "\nrank 1:\n" << slurp(dir + "/log1");

  std::vector<std::vector<float>> losses(kWorld);
  std::vector<torch::Tensor> params, buffers;
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_model(kind);
    if (r == 0) copy_parameters(*model, init);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm);
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(ddp.forward(x[s].narrow(0, r * kRows, kRows)),
                                            y[s].narrow(0, r * kRows, kRows));
      loss.backward();
      opt.step();
      losses[r].push_back(loss.item<float>());
    }
    if (r == 0) {
      params = clone_all(model->parameters());
      buffers = clone_all(model->buffers());
    }
  });

  for (int r = 0; r < kWorld; ++r) {
    auto theirs = read_raw(dir + "/torch_losses_" + std::to_string(r) + ".bin", torch::empty({kSteps}));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(losses[r][s], theirs[s].item<float>(), 1e-5) << kind << " rank " << r << " step " << s;
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto theirs = read_raw(dir + "/torch_param_" + std::to_string(i) + ".bin", params[i]);
    EXPECT_LT((params[i] - theirs).abs().max().item<double>(), 1e-5) << kind << " parameter " << i;
  }
  ASSERT_EQ(buffers.empty(), kind == "mlp");
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto theirs = read_raw(dir + "/torch_buffer_" + std::to_string(i) + ".bin", buffers[i]);
    EXPECT_LT((buffers[i].to(torch::kDouble) - theirs.to(torch::kDouble)).abs().max().item<double>(), 1e-5)
        << kind << " buffer " << i;
  }
  // Training moved the parameters, so the comparison is not trivially true.
  EXPECT_GT(max_abs_diff(params, init), 1e-3);
  std::system(("rm -rf " + dir).c_str());
}

INSTANTIATE_TEST_SUITE_P(Ddp, PyTorchReference, ::testing::Values("mlp", "cnn"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cohort::testing
