// defines: PointToPoint, the tagged send/recv that the collective algorithms
// (cohort/algorithms' Link) run on, and EnginePointToPoint, an Engine's.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "cohort/core/engine.h"
#include "cohort/core/work.h"

namespace cohort {

/// Tagged point-to-point among `size()` ranks: all a collective algorithm needs of a transport.
/// An Engine's send/recv (EnginePointToPoint), UCX's collective channel and a Communicator's own
/// tag space (CommunicatorPointToPoint) provide it.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  /// This process's rank.
  virtual int rank() const = 0;
  /// The number of ranks.
  virtual int size() const = 0;
  /// Sends `tensor` to rank `dst`, matched by (sender, tag).
  virtual WorkPtr send(at::Tensor& tensor, int dst, int tag) = 0;
  /// Receives the message rank `src` sent with `tag` into `tensor`.
  virtual WorkPtr recv(at::Tensor& tensor, int src, int tag) = 0;
};

/// An Engine's own send/recv as a PointToPoint.
class EnginePointToPoint final : public PointToPoint {
 public:
  /// `engine` must outlive this view.
  explicit EnginePointToPoint(Engine& engine) : engine_(engine) {}
  int rank() const override { return engine_.rank(); }
  int size() const override { return engine_.size(); }
  WorkPtr send(at::Tensor& tensor, int dst, int tag) override {
    return engine_.send(tensor, dst, tag);
  }
  WorkPtr recv(at::Tensor& tensor, int src, int tag) override {
    return engine_.recv(tensor, src, tag);
  }

 private:
  Engine& engine_;
};

}  // namespace cohort
