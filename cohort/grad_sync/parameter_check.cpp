#include "cohort/grad_sync/parameter_check.h"

#include <algorithm>
#include <sstream>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

struct ParamSignature {
  int64_t dtype = 0;
  std::vector<int64_t> sizes;
  bool operator==(const ParamSignature& o) const { return dtype == o.dtype && sizes == o.sizes; }
};

// [count, then per parameter: dtype, ndim, sizes...] as int64.
std::vector<int64_t> encode(const std::vector<torch::Tensor>& params) {
  std::vector<int64_t> out{static_cast<int64_t>(params.size())};
  for (const auto& p : params) {
    out.push_back(static_cast<int64_t>(p.scalar_type()));
    out.push_back(p.dim());
    for (auto s : p.sizes()) out.push_back(s);
  }
  return out;
}

std::vector<ParamSignature> decode(const std::vector<int64_t>& words) {
  const int64_t* d = words.data();
  std::vector<ParamSignature> out(d[0]);
  int64_t pos = 1;
  for (auto& sig : out) {
    sig.dtype = d[pos++];
    const int64_t ndim = d[pos++];
    sig.sizes.assign(d + pos, d + pos + ndim);
    pos += ndim;
  }
  return out;
}

std::string describe(const ParamSignature& s) {
  std::ostringstream os;
  os << c10::toString(static_cast<c10::ScalarType>(s.dtype)) << " [";
  for (size_t i = 0; i < s.sizes.size(); ++i) os << (i ? ", " : "") << s.sizes[i];
  os << "]";
  return os.str();
}

}  // namespace

void verify_same_parameters(Communicator& comm, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names, const std::string& who) {
  const int n = comm.size();
  if (n == 1) return;
  // Signatures differ in length across ranks when the models differ.
  const auto all = gather_varying_words(comm, encode(params));
  const auto reference = decode(all[0]);
  for (int r = 1; r < n; ++r) {
    const auto other = decode(all[r]);
    const size_t common = std::min(reference.size(), other.size());
    std::ostringstream os;
    os << who << ": on rank " << comm.rank() << " of " << n << " (group " << comm.name()
       << "), the model differs across ranks: ";
    for (size_t i = 0; i < common; ++i) {
      if (reference[i] == other[i]) continue;
      os << "parameter " << i;
      if (i < names.size()) os << " ('" << names[i] << "' on this rank)";
      os << " is " << describe(reference[i]) << " on rank 0 but " << describe(other[i])
         << " on rank " << r;
      throw MismatchError(os.str());
    }
    if (reference.size() != other.size()) {
      const size_t i = common;
      os << "rank 0 has " << reference.size() << " parameters but rank " << r << " has "
         << other.size() << "; the first extra one is parameter " << i;
      if (i < names.size()) os << " ('" << names[i] << "' on this rank)";
      throw MismatchError(os.str());
    }
  }
}

}  // namespace cohort
