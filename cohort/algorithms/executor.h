// defines: Executor, what a Communicator hands its algorithm-run collectives
// to: a private engine, a worker thread, the hierarchy and the cost model.
//
// Private engine: at the first algorithm-run collective (which every rank
// reaches at the same point, since collectives are ordered) the executor
// builds an engine of its own over the same ranks (Engine::create_subgroup,
// like MPI_Comm_dup), so algorithm messages never meet the user's tagged
// send/recv, and the engine's own collectives stay ordered on theirs.
//
// Asynchrony: one worker thread (a SerialWorker) runs jobs in the order they
// were issued (which is the same on every rank). A job's Work completes when the job
// finishes; every wait inside it is bounded by the operation's deadline. A
// failed job fails every later one: the peers' state is unknown.
#pragma once

#include <functional>
#include <map>
#include <memory>

#include "cohort/algorithms/calibration.h"
#include "cohort/algorithms/hierarchical.h"
#include "cohort/algorithms/link.h"
#include "cohort/core/algorithm.h"
#include "cohort/core/serial_worker.h"
#include "cohort/core/store/store.h"

namespace cohort::algorithms {

class Executor {
 public:
  // Collective over the ranks of `parent`. Reads the options' timeout, node
  // and calibration_max_bytes (resolved: positive).
  Executor(Engine& parent, const std::shared_ptr<Store>& store, CommunicatorOptions options);
  ~Executor();

  // The concrete algorithm for `op` on `bytes` (the whole vector):
  // Adaptive asks the cost model (calibrating it first: collective and
  // blocking); tree and hierarchical run reduce-scatter and all-gather as
  // the ring does. May return Engine.
  Algorithm resolve(Collective op, Algorithm requested, int64_t bytes);

  // Flat, contiguous tensors of a reduction dtype; `op` is not Avg.
  WorkPtr all_reduce(at::Tensor buf, ReduceOp op, Algorithm algo, Millis timeout);
  // out = reduction of block rank() of every rank's `in` (size() blocks).
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, Algorithm algo,
                         Millis timeout);
  // out = size() blocks, block r from rank r's `in`.
  WorkPtr all_gather(at::Tensor out, at::Tensor in, Algorithm algo, Millis timeout);

  // The calibration behind adaptive's choices for `op` (runs it if needed).
  const Calibration& calibration(Collective op);

 private:
  using Job = std::function<void(Link&)>;
  WorkPtr submit(std::string what, Millis timeout, Job job);
  // One timed call of a calibration candidate (calibration()'s measure):
  // `vote` summed over the ranks, read back from the result.
  struct ProbeBuffers;
  double probe(Collective op, Algorithm algo, int64_t bytes, double vote, ProbeBuffers& buffers);
  // Synchronous forms, run on the worker thread.
  void run_all_reduce(Link& link, at::Tensor& buf, ReduceOp op, Algorithm algo);
  void run_reduce_scatter(Link& link, at::Tensor& out, const at::Tensor& in, ReduceOp op,
                          Algorithm algo);
  void run_all_gather(Link& link, at::Tensor& out, const at::Tensor& in, Algorithm algo);
  const Topology& topology();
  Hierarchy& hierarchy();
  std::vector<Algorithm> candidates(Collective op);

  CommunicatorOptions options_;
  std::shared_ptr<Store> store_;     // the executor's own key space
  std::unique_ptr<Engine> engine_;   // private: the worker's (and calibration's)
  Engine& parent_;                   // the Communicator's: calibration times its collective
  Scratch scratch_;                  // worker only
  std::unique_ptr<Topology> topology_;    // worker only, built on first use
  std::unique_ptr<Hierarchy> hierarchy_;  // worker only, built on first use
  std::map<Collective, Calibration> calibrations_;  // caller thread only

  std::unique_ptr<SerialWorker> worker_;  // last: its jobs use everything above
};

}  // namespace cohort::algorithms
