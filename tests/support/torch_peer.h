// defines: PyTorch peers for golden tests: run_torch_peers (a Python script
// as `world` processes of one gloo job, with the variables torchrun would
// set), probe_torch_peer (whether this PyTorch has what a script needs),
// expect_golden (a comparison and its negative control), and the raw tensor
// files the two sides exchange.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

namespace cohort::testing {

// Debian's python3-torch: 1.13 on Debian 12, 2.6 on Debian 13 (the
// python3 on PATH has no torch). Its torchrun is broken, so the peers are
// started here.
inline constexpr const char* kTorchPython = "/usr/bin/python3";

// A tensor's bytes, contiguous and in its dtype (what the scripts read with
// torch.frombuffer); read_raw reads one shaped and typed as `like`.
void write_raw(const std::string& path, const torch::Tensor& t);
torch::Tensor read_raw(const std::string& path, const torch::Tensor& like);
// A float32 tensor of `shape`.
torch::Tensor read_raw(const std::string& path, at::IntArrayRef shape);

// A loopback TCP port that was free a moment ago.
int free_loopback_port();

// `script --probe`: nothing when the script can run, the reason it printed
// when it exits 77 (this PyTorch lacks the API), else an exception with its
// output.
std::optional<std::string> probe_torch_peer(const std::string& script);

// Runs `script args...` as ranks 0..world-1 of one gloo job (RANK,
// WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT, one thread each) and
// waits up to `limit_s` seconds for all of them. Returns "" when every rank
// exited 0, else each rank's exit code and output.
std::string run_torch_peers(const std::string& script, const std::vector<std::string>& args,
                            int world, double limit_s);

// A golden comparison and its negative control: `diff`, cohort against the
// peer's reference run, must be at most `tolerance`; `control`, the same
// measure against the peer's deliberately perturbed run, must exceed it
// (else the check could not tell them apart). Prints both figures.
void expect_golden(double diff, double control, double tolerance, const std::string& what);

}  // namespace cohort::testing
