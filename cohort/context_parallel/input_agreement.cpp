// What one rank can refuse alone (rank, dtype, k or v unlike q) travels as a
// code beside the shape, so the other ranks can name the reason too.
#include "cohort/context_parallel/input_agreement.h"

#include <array>
#include <cstring>
#include <sstream>
#include <string>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort::context_parallel {

namespace {

constexpr int kWords = 7;  // code, batch, heads, rows, head_dim, dtype, scale's bits
const std::array<const char*, 4> kRefusals = {
    "",
    "q, k and v must be 4-D [batch, heads, sequence, head_dim]",
    "k and v must have q's shape",
    "q, k and v must be CPU tensors of one dtype, float32 or float64",
};

int64_t refusal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (q.dim() != 4) return 1;
  if (k.sizes() != q.sizes() || v.sizes() != q.sizes()) return 2;
  const bool floating = q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble;
  const bool alike = k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type();
  const bool cpu = q.is_cpu() && k.is_cpu() && v.is_cpu();
  return floating && alike && cpu ? 0 : 3;
}

std::string shape_of(const int64_t* w) {
  std::ostringstream os;
  os << "[" << w[1] << ", " << w[2] << ", " << w[3] << ", " << w[4] << "] "
     << c10::toString(static_cast<c10::ScalarType>(w[5]));
  return os.str();
}

}  // namespace

ZigZagLayout agree_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          Communicator& group, Millis timeout, double scale) {
  const int cp = group.size();
  const std::string where = "cohort: ring_attention on rank " + std::to_string(group.rank()) +
                            " of " + std::to_string(cp) + " (group " + group.name() + "): ";
  const int64_t code = refusal(q, k, v);
  auto mine = torch::zeros({kWords}, torch::kInt64);
  auto* m = mine.data_ptr<int64_t>();
  m[0] = code;
  for (int d = 0; d < 4 && code != 1; ++d) m[1 + d] = q.size(d);
  m[5] = static_cast<int64_t>(q.scalar_type());
  std::memcpy(&m[6], &scale, sizeof scale);
  auto all = torch::empty({cp * kWords}, torch::kInt64);
  group.all_gather_into_tensor(all, mine, {timeout}).wait();
  const auto* w = all.data_ptr<int64_t>();
  for (int r = 0; r < cp; ++r) {
    if (w[r * kWords] != 0) {
      throw InvalidArgument(where + "rank " + std::to_string(r) + "'s inputs are refused: " +
                            kRefusals[static_cast<size_t>(w[r * kWords])]);
    }
  }
  int64_t length = 0;
  bool same = true;
  for (int r = 0; r < cp; ++r) {
    const auto* x = w + r * kWords;
    same = same && x[1] == w[1] && x[2] == w[2] && x[4] == w[4] && x[5] == w[5];
    length += x[3];
  }
  if (!same) {
    std::string all_shapes;
    for (int r = 0; r < cp; ++r) {
      all_shapes += (r ? ", rank " : "rank ") + std::to_string(r) + " " + shape_of(w + r * kWords);
    }
    throw InvalidArgument(where + "ranks differ in batch, heads, head_dim or dtype: " + all_shapes);
  }
  for (int r = 0; r < cp; ++r) {
    if (w[r * kWords + 6] == w[6]) continue;
    double theirs = 0, first = 0;
    std::memcpy(&theirs, &w[r * kWords + 6], sizeof theirs);
    std::memcpy(&first, &w[6], sizeof first);
    throw InvalidArgument(where + "ranks differ in the softmax scale: rank 0 has " +
                          double_text(first) + ", rank " + std::to_string(r) + " has " +
                          double_text(theirs));
  }
  if (length < 2 * static_cast<int64_t>(cp)) {
    throw InvalidArgument(where + "the sequence of " + std::to_string(length) +
                          " positions is shorter than its 2·cp = " + std::to_string(2 * cp) +
                          " zig-zag chunks (each chunk needs at least one position)");
  }
  const ZigZagLayout layout(length, cp);
  for (int r = 0; r < cp; ++r) {
    if (w[r * kWords + 3] != layout.local_length(r)) {
      throw InvalidArgument(where + "rank " + std::to_string(r) + " holds " +
                            std::to_string(w[r * kWords + 3]) +
                            " positions; the zig-zag layout of " + std::to_string(length) +
                            " over cp = " + std::to_string(cp) + " gives it " +
                            std::to_string(layout.local_length(r)));
    }
  }
  return layout;
}

}  // namespace cohort::context_parallel
