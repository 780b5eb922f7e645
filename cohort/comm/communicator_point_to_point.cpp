#include "cohort/comm/communicator_point_to_point.h"

namespace cohort {
namespace {

// The communicator's Work (which runs its completion step and names the
// operation in errors) seen as the WorkImpl a Link waits on.
class HandleWork final : public WorkImpl {
 public:
  explicit HandleWork(Work work) : work_(std::move(work)) {}
  bool is_completed() override { return work_.is_completed(); }
  void wait(Millis timeout) override { work_.wait(timeout); }

 private:
  Work work_;
};

}  // namespace

WorkPtr CommunicatorPointToPoint::send(at::Tensor& tensor, int dst, int tag) {
  return std::make_shared<HandleWork>(comm_.send(tensor, dst, {tag_base_ + tag}));
}

WorkPtr CommunicatorPointToPoint::recv(at::Tensor& tensor, int src, int tag) {
  return std::make_shared<HandleWork>(comm_.recv(tensor, src, {tag_base_ + tag}));
}

}  // namespace cohort
