#include "cohort/dcp/collective_status.h"

#include <algorithm>
#include <cstring>

#include "cohort/dcp/checkpoint_file.h"

namespace cohort::dcp {
namespace {

torch::Tensor bytes_of(const std::string& s, int64_t padded) {
  auto t = torch::zeros({padded}, torch::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string string_of(const torch::Tensor& t, int64_t length) {
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(length));
}

// Every rank's length, on every rank.
std::vector<int64_t> all_lengths(Communicator& comm, int64_t mine) {
  std::vector<torch::Tensor> out;
  for (int r = 0; r < comm.size(); ++r) out.push_back(torch::empty({1}, torch::kLong));
  comm.all_gather(out, torch::tensor({mine}, torch::kLong)).wait();
  std::vector<int64_t> lengths;
  for (const auto& t : out) lengths.push_back(t.item<int64_t>());
  return lengths;
}

}  // namespace

ErrorKind kind_of(const std::exception& e) {
  if (dynamic_cast<const InvalidArgument*>(&e)) return ErrorKind::InvalidArgument;
  if (dynamic_cast<const ConfigError*>(&e)) return ErrorKind::Config;
  return ErrorKind::Checkpoint;
}

void agree(Communicator& comm, const std::string& error, ErrorKind kind) {
  // A failing rank sends its kind as the first byte, then its message.
  const std::string mine = error.empty() ? error : static_cast<char>(kind) + error;
  const auto lengths = all_lengths(comm, static_cast<int64_t>(mine.size()));
  int64_t longest = 0;
  for (auto n : lengths) longest = std::max(longest, n);
  if (longest == 0) return;
  std::vector<torch::Tensor> out;
  for (int r = 0; r < comm.size(); ++r) out.push_back(torch::empty({longest}, torch::kByte));
  comm.all_gather(out, bytes_of(mine, longest)).wait();
  for (int r = 0; r < comm.size(); ++r) {
    if (lengths[r] != 0) throw_agreed(r, string_of(out[r], lengths[r]));
  }
}

void throw_agreed(int rank, const std::string& text) {
  const auto message = "rank " + std::to_string(rank) + ": " + text.substr(1);
  switch (static_cast<ErrorKind>(text.at(0))) {
    case ErrorKind::InvalidArgument:
      throw InvalidArgument(message);
    case ErrorKind::Config:
      throw ConfigError(message);
    default:
      throw CheckpointError(message);
  }
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const auto lengths = all_lengths(comm, static_cast<int64_t>(mine.size()));
  int64_t longest = 1;
  for (auto n : lengths) longest = std::max(longest, n);
  std::vector<torch::Tensor> out;
  for (int r = 0; r < comm.size(); ++r) out.push_back(torch::empty({longest}, torch::kByte));
  comm.all_gather(out, bytes_of(mine, longest)).wait();
  std::vector<std::string> strings;
  for (int r = 0; r < comm.size(); ++r) strings.push_back(string_of(out[r], lengths[r]));
  return strings;
}

std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine, int root) {
  const auto lengths = all_lengths(comm, static_cast<int64_t>(mine.size()));
  int64_t longest = 1;
  for (auto n : lengths) longest = std::max(longest, n);
  std::vector<torch::Tensor> out;
  if (comm.rank() == root) {
    for (int r = 0; r < comm.size(); ++r) out.push_back(torch::empty({longest}, torch::kByte));
  }
  comm.gather(out, bytes_of(mine, longest), {root}).wait();
  std::vector<std::string> strings;
  for (size_t r = 0; r < out.size(); ++r) strings.push_back(string_of(out[r], lengths[r]));
  return strings;
}

}  // namespace cohort::dcp
