// defines: Engine, the interface every transport implements (Gloo and NCCL
// through c10d, MPI, UCX), and WorkPtr.
//
// The Communicator validates and prepares tensors (contiguous, CPU unless
// the engine carries device tensors, a dtype the wire carries) before it
// calls an engine, so engines stay thin. An engine implements what it
// supports; the defaults below either build the operation
// from others (reduce_scatter) or refuse it by name.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "cohort/core/types.h"
#include "cohort/core/work.h"

namespace cohort {

class Store;
using WorkPtr = std::shared_ptr<WorkImpl>;

/// The transport under a Communicator (Gloo through c10d, MPI): plain operations on contiguous CPU
/// tensors, each returning a WorkImpl. Add an engine by implementing this interface and registering
/// it (CONTRIBUTING.md).
class Engine {
 public:
  virtual ~Engine() = default;

  /// The backend's name, e.g. "gloo".
  virtual std::string name() const = 0;
  /// This process's rank among the engine's ranks.
  virtual int rank() const = 0;
  /// The number of ranks.
  virtual int size() const = 0;

  /// Reductions receive Sum, Min, Max or Prod (Avg is a Sum divided above the
  /// engine) on f32, f64, i32, i64 or u8 (f16/bf16 are reduced in f32 above).
  virtual WorkPtr all_reduce(at::Tensor& tensor, ReduceOp op) = 0;
  /// Copies the root's tensor to every rank.
  virtual WorkPtr broadcast(at::Tensor& tensor, int root) = 0;
  /// Reduces every rank's tensor into the root's.
  virtual WorkPtr reduce(at::Tensor& tensor, int root, ReduceOp op) = 0;
  /// outputs[i] receives rank i's input.
  virtual WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) = 0;
  /// output = op over ranks of inputs[rank()]. Default: an all_reduce of the
  /// concatenated inputs (twice the minimal traffic); engines override.
  virtual WorkPtr reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op);
  /// True when reduce_scatter above is the transport's own (not the default
  /// built from all_reduce); without one, the communicator's "engine" choice
  /// for reduce_scatter means cohort's ring (cohort/algorithms).
  virtual bool has_native_reduce_scatter() const { return false; }
  /// False when the communicator should serve a large all-gather of host
  /// tensors with cohort's ring rather than this all_gather: c10d's Gloo
  /// gathers into a buffer it allocates per call and copies out of it (a
  /// second pass over the output), where the ring receives in place (the
  /// communicator's "engine" choice, from 4 MiB; cohort/algorithms).
  virtual bool gathers_into_outputs() const { return true; }
  /// True when the transport moves device (CUDA) tensors itself (NCCL): the
  /// Communicator then hands them over as they are, without staging them
  /// through host memory, and runs no algorithm of cohort's on them (those
  /// read host memory).
  virtual bool carries_device_tensors() const { return false; }
  /// True when Min and Max of floating tensors propagate NaN, as at::minimum and at::maximum do
  /// (UCX's do). Where false (c10d's Gloo and MPI, NCCL compare with `<`), the Communicator reduces
  /// floating Min and Max as integer order keys (cohort/comm/order_keys.h).
  virtual bool propagates_nan() const { return false; }
  /// On the root, outputs has size() tensors; elsewhere it is empty.
  virtual WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) = 0;
  /// On the root, inputs has size() tensors; elsewhere it is empty.
  virtual WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) = 0;
  /// Flat buffers; counts are elements per rank (empty: equal split).
  virtual WorkPtr all_to_all(at::Tensor& output, at::Tensor& input,
                             std::vector<int64_t>& output_counts,
                             std::vector<int64_t>& input_counts) = 0;
  /// Completes once every rank has called it.
  virtual WorkPtr barrier() = 0;
  /// Sends `tensor` to rank `dst`, matched by (sender, tag).
  virtual WorkPtr send(at::Tensor& tensor, int dst, int tag) = 0;
  /// Receives the message rank `src` sent with `tag` into `tensor`.
  virtual WorkPtr recv(at::Tensor& tensor, int src, int tag) = 0;

  /// Called by the members of a new group only, all at once: an engine for
  /// `ranks` (this engine's ranks, in the new group's order). `store` is the
  /// new group's own key space.
  virtual std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                                  std::shared_ptr<Store> store, Millis timeout) = 0;

 protected:
  /// Throws Unsupported naming this engine and the operation `what`.
  [[noreturn]] void unsupported(const std::string& what) const;
};

}  // namespace cohort
