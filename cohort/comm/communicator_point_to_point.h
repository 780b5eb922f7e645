// defines: CommunicatorPointToPoint, a Communicator's send/recv in a tag
// space of the caller's own, as the PointToPoint the algorithms run on.
#pragma once

#include "cohort/comm/communicator.h"
#include "cohort/core/point_to_point.h"

namespace cohort {

/// A Communicator's send/recv with every tag moved up by `tag_base`, as a PointToPoint: collectives
/// written over the algorithms' Link (compression's) run on a communicator, their transfers
/// validated and counted as the communicator's own send/recv are, and never matching a user's
/// messages whose tags stay below `tag_base`.
class CommunicatorPointToPoint final : public PointToPoint {
 public:
  /// `comm` must outlive this view.
  CommunicatorPointToPoint(Communicator& comm, int tag_base) : comm_(comm), tag_base_(tag_base) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  WorkPtr send(at::Tensor& tensor, int dst, int tag) override;
  WorkPtr recv(at::Tensor& tensor, int src, int tag) override;

 private:
  Communicator& comm_;
  int tag_base_;
};

}  // namespace cohort
