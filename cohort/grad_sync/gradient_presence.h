// defines: any_rank_has, the one answer to "does any rank have this
// parameter's gradient?" for DDP (unused parameters), average_gradients,
// ZeRO and the fused optimizer (parameters the optimizer must skip).
//
// A parameter with a gradient on some ranks only is reduced with zeros from
// the others; one with a gradient on no rank keeps no gradient, as in
// single-process training, so the optimizer skips it as LibTorch skips an
// undefined .grad.
#pragma once

#include <exception>
#include <string>
#include <vector>

namespace cohort {

class Communicator;

/// Collective over `comm` (one small all-reduce; none at world size 1): per
/// entry, whether any rank's `local` is nonzero.
std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local);

/// The same all-reduce carrying one more entry per rank: whether that rank
/// refuses to go on (`refusal` not empty), so that a step one rank cannot
/// take is refused on every rank at no extra collective. Throws
/// InvalidArgument on every rank when any rank refuses: `where: refusal` on
/// the refusing ranks, `where` naming those ranks on the others.
std::vector<char> any_rank_has_unless_refused(Communicator& comm, const std::vector<char>& local,
                                              const std::string& refusal, const std::string& where);

/// The same all-reduce carrying one more entry per rank: the kind of the
/// exception that ended its share of the step (`failed`, null where it ran:
/// a pipeline replica's stage that threw), so that a step one replica could
/// not finish is an error on every rank before any gradient is sent, at no
/// extra collective on the normal path. When some rank failed, the failing
/// ranks' messages follow in one all-gather of texts, and every rank throws:
/// a failing rank its own exception, the others one of the first failing
/// rank's kind (StageError, InvalidArgument, TimeoutError, PeerError, else
/// Error) saying `where`, the failing ranks and their messages.
std::vector<char> any_rank_has_unless_failed(Communicator& comm, const std::vector<char>& local,
                                             const std::exception_ptr& failed,
                                             const std::string& where);

}  // namespace cohort
