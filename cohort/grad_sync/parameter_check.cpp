#include "cohort/grad_sync/parameter_check.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/rank_local.h"
#include "cohort/core/tensor_checks.h"

namespace cohort {
namespace {

struct ParamSignature {
  int64_t dtype = 0;
  std::vector<int64_t> sizes;
  TensorParallelPart tp;  // the part it holds of a tensor split over TP ({0, 1}: whole)
  // The dtype and shape (the TP parts are compared apart).
  bool operator==(const ParamSignature& o) const { return dtype == o.dtype && sizes == o.sizes; }
};

// [refused, count, then per parameter: dtype, ndim, sizes..., TP rank, TP
// size] as int64.
std::vector<int64_t> encode(bool refused, const std::vector<torch::Tensor>& params) {
  std::vector<int64_t> out{refused ? 1 : 0, static_cast<int64_t>(params.size())};
  for (const auto& p : params) {
    out.push_back(static_cast<int64_t>(p.scalar_type()));
    out.push_back(p.dim());
    for (auto s : p.sizes()) out.push_back(s);
    const auto tp = tensor_parallel_part(p);
    out.push_back(tp.rank);
    out.push_back(tp.size);
  }
  return out;
}

std::vector<ParamSignature> decode(const std::vector<int64_t>& words) {
  const int64_t* d = words.data();
  std::vector<ParamSignature> out(d[1]);
  int64_t pos = 2;
  for (auto& sig : out) {
    sig.dtype = d[pos++];
    const int64_t ndim = d[pos++];
    sig.sizes.assign(d + pos, d + pos + ndim);
    pos += ndim;
    sig.tp.rank = d[pos++];
    sig.tp.size = d[pos++];
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

// Bytes per block of values_digest: blocks are digested in parallel and
// folded in order, so the digest does not depend on the thread count.
constexpr int64_t kDigestBlock = 4 << 20;

// The digest of one tensor's values (its bytes in row-major order).
uint64_t values_digest(const torch::Tensor& t) {
  const auto host = t.detach().to(torch::kCPU).contiguous();
  const auto* bytes = static_cast<const unsigned char*>(host.data_ptr());
  const int64_t total = static_cast<int64_t>(host.nbytes());
  const int64_t blocks = (total + kDigestBlock - 1) / kDigestBlock;
  std::vector<int64_t> digests(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t at = b * kDigestBlock;
      digests[static_cast<size_t>(b)] = static_cast<int64_t>(
          content_digest(bytes + at, static_cast<size_t>(std::min(kDigestBlock, total - at))));
    }
  });
  return fnv1a_words(digests, static_cast<uint64_t>(total));
}

// With the same parameters on every rank: InvalidArgument on every rank when
// a parameter split over TP holds other TP ranks' parts on the ranks of
// `comm`. Each rank names the first such parameter (the same on every rank)
// and the first rank whose part differs from its own.
void refuse_mixed_parts(const Communicator& comm,
                        const std::vector<std::vector<ParamSignature>>& all,
                        const std::vector<torch::Tensor>& params,
                        const std::vector<std::string>& names, const std::string& who) {
  const auto& mine = all[static_cast<size_t>(comm.rank())];
  for (size_t i = 0; i < mine.size(); ++i) {
    for (int r = 0; r < comm.size(); ++r) {
      const auto& theirs = all[static_cast<size_t>(r)][i].tp;
      if (theirs.rank == mine[i].tp.rank && theirs.size == mine[i].tp.size) continue;
      const auto here = tensor_parallel_part(params[i]);
      const std::string param =
          i < names.size() ? "parameter '" + names[i] + "'" : "parameter " + std::to_string(i);
      throw InvalidArgument(who + ": on rank " + std::to_string(comm.rank()) + " of " +
                            std::to_string(comm.size()) + " (group " + comm.name() + "), " +
                            tensor_parallel_part_refusal(param, here, r, theirs));
    }
  }
}

std::string hex(int64_t word) {
  char text[20];
  std::snprintf(text, sizeof text, "%016llx",
                static_cast<unsigned long long>(static_cast<uint64_t>(word)));
  return text;
}

}  // namespace

std::vector<int64_t> tensor_parallel_words(const std::vector<torch::Tensor>& params) {
  std::vector<int64_t> out;
  for (const auto& p : params) {
    const auto tp = tensor_parallel_part(p);
    out.push_back(tp.rank);
    out.push_back(tp.size);
  }
  return out;
}

void refuse_mixed_tensor_parallel_parts(Communicator& comm,
                                        const std::vector<torch::Tensor>& params,
                                        const std::vector<std::string>& names,
                                        const std::string& who) {
  const RankWords each = gather_words(comm, tensor_parallel_words(params));
  std::vector<std::vector<ParamSignature>> signatures;
  for (int r = 0; r < each.ranks(); ++r) {
    std::vector<ParamSignature> sigs(params.size());
    for (size_t i = 0; i < sigs.size(); ++i) {
      sigs[i].tp.rank = each.of(r)[2 * i];
      sigs[i].tp.size = each.of(r)[2 * i + 1];
    }
    signatures.push_back(std::move(sigs));
  }
  refuse_mixed_parts(comm, signatures, params, names, who);
}

void verify_same_values(Communicator& comm, const std::vector<torch::Tensor>& params,
                        const std::vector<std::string>& names, const std::string& who,
                        const std::string& remedy) {
  if (comm.size() == 1) return;
  std::vector<int64_t> digests;
  digests.reserve(params.size());
  for (const auto& p : params) digests.push_back(static_cast<int64_t>(values_digest(p)));
  // One word per rank in the common case; the per-parameter words only
  // when they differ, to name the parameter (every rank sees the difference,
  // so every rank takes this second all-gather).
  if (gather_words(comm, {static_cast<int64_t>(fnv1a_words(digests))}).same()) return;
  const RankWords all = gather_words(comm, digests);
  auto differs = [&all](size_t i) {
    for (int r = 1; r < all.ranks(); ++r) {
      if (all.of(r)[i] != all.of(0)[i]) return true;
    }
    return false;
  };
  size_t first = 0;
  while (first + 1 < params.size() && !differs(first)) ++first;
  const auto values =
      all.values([first](const int64_t* w) { return "values digest " + hex(w[first]); });
  std::ostringstream os;
  os << who << ": on rank " << comm.rank() << " of " << comm.size() << " (group " << comm.name()
     << "), the ranks start from different parameter values: parameter " << first;
  if (first < names.size()) os << " ('" << names[first] << "' on this rank)";
  os << ", " << dtype_name(params[first].scalar_type()) << " " << params[first].sizes()
     << ", differs (" << name_groups(values) << "); " << remedy;
  throw MismatchError(os.str());
}

void verify_not_rank_local(Communicator& comm, const std::vector<torch::Tensor>& params,
                           const std::vector<std::string>& names, const std::string& who) {
  const auto local = rank_local_refusal(params, names);
  auto where = [&] {
    return who + ": on rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
           " (group " + comm.name() + "), ";
  };
  if (comm.size() == 1) {
    if (!local.empty()) throw InvalidArgument(where() + local);
    return;
  }
  const RankWords all = gather_words(comm, {local.empty() ? 0 : 1});
  if (!local.empty()) throw InvalidArgument(where() + local);
  std::vector<char> refused;
  for (int r = 0; r < all.ranks(); ++r) refused.push_back(all.of(r)[0] != 0 ? 1 : 0);
  const std::string refusing = flagged_ranks(refused);
  if (!refusing.empty()) {
    throw InvalidArgument(where() + "the parameters of " + refusing +
                          " hold one rank's part of a split tensor (the error there names it), "
                          "so no rank goes on");
  }
}

void verify_same_tensor_parallel_parts(Communicator& comm, const std::vector<torch::Tensor>& params,
                                       const std::vector<std::string>& names,
                                       const std::string& who) {
  if (comm.size() == 1) return;
  // The parts travel as a digest; per parameter only when they differ, to
  // name the parameter (every rank sees the difference).
  const RankWords all =
      gather_words(comm, {static_cast<int64_t>(params.size()),
                          static_cast<int64_t>(fnv1a_words(tensor_parallel_words(params)))});
  if (all.same()) return;
  const auto counts = all.values([](const int64_t* w) { return std::to_string(w[0]); });
  if (!all_same(counts)) {
    throw MismatchError(
        who + ": on rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
        " (group " + comm.name() +
        "), the ranks hold different numbers of parameters: " + name_groups(counts));
  }
  refuse_mixed_tensor_parallel_parts(comm, params, names, who);
}

void verify_same_parameters(Communicator& comm, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names, const std::string& who,
                            std::exception_ptr refusal) {
  const int n = comm.size();
  // A rank's part of a split tensor (an MoE's experts) is not one replicated
  // parameter: broadcast or averaged over this group it would be replaced by
  // or mixed with other ranks' parts.
  if (!refusal) {
    const auto local = rank_local_refusal(params, names);
    if (!local.empty()) {
      std::ostringstream os;
      os << who << ": on rank " << comm.rank() << " of " << n << " (group " << comm.name() << "), "
         << local;
      refusal = std::make_exception_ptr(InvalidArgument(os.str()));
    }
  }
  if (n == 1 && refusal) std::rethrow_exception(refusal);
  if (n == 1) return;
  // Signatures differ in length across ranks when the models differ.
  const auto all = gather_varying_words(comm, encode(refusal != nullptr, params));
  std::vector<char> refused;
  for (const auto& words : all) refused.push_back(words[0] != 0 ? 1 : 0);
  const std::string refusing = flagged_ranks(refused);
  if (refusal) std::rethrow_exception(refusal);
  if (!refusing.empty()) {
    std::ostringstream os;
    os << who << ": on rank " << comm.rank() << " of " << n << " (group " << comm.name() << "), "
       << refusing << " refused (the error there says why), so no rank "
       << "goes on";
    throw InvalidArgument(os.str());
  }
  std::vector<std::vector<ParamSignature>> signatures;
  for (const auto& words : all) signatures.push_back(decode(words));
  const auto& reference = signatures[0];
  for (int r = 1; r < n; ++r) {
    const auto& other = signatures[r];
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
  refuse_mixed_parts(comm, signatures, params, names, who);
}

}  // namespace cohort
