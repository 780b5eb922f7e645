// dcp::async_save: the staging copy and the agreement at the call, the file
// on a writer thread, the commit at wait() (see async_save.h for why).
#include "cohort/dcp/async_save.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/save_steps.h"

namespace cohort::dcp {

struct AsyncSave::State {
  State(Communicator& c, std::string d) : comm(c), dir(std::move(d)) {}
  ~State() {
    if (writer.joinable()) writer.join();
  }
  std::string where() const {
    return "dcp::async_save of " + dir + " on rank " + std::to_string(comm.rank());
  }

  Communicator& comm;
  const std::string dir;
  StagedFile staged;
  torch::Tensor arena;  // the staging memory staged.data views; the next save reuses it
  std::thread writer;
  // Set by the writer, under mu.
  std::mutex mu;
  std::condition_variable done;
  bool written = false;
  std::string list;   // the chunk list for commit()
  std::string error;  // the write's error, "" when none
  // The caller's thread only.
  bool committed = false;
  std::exception_ptr outcome;
};

namespace {

// The save pending on each communicator (collectives are ordered per
// communicator; different communicators save independently).
std::mutex registry_mu;
std::map<const Communicator*, std::weak_ptr<AsyncSave::State>> registry;

void write_in_background(AsyncSave::State& s) {
  // The writer yields the CPU to the training: where the ranks keep every
  // core busy (a CPU job) its checksums and page-cache copies would
  // otherwise come out of the step time; it runs in the gaps instead, and
  // the next save waits if it has not finished. Best effort: a failure
  // leaves the default priority.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  std::string list, error;
  try {
    list = write_staged_file(s.staged, s.dir, s.comm.rank());
  } catch (const std::exception& e) {
    error = s.where() + ": background write: " + e.what();
  } catch (...) {
    error = s.where() + ": background write: unknown exception";
  }
  s.staged.data.clear();  // the staging memory goes back now, not at wait()
  std::lock_guard<std::mutex> lock(s.mu);
  s.written = true;
  s.list = std::move(list);
  s.error = std::move(error);
  s.done.notify_all();
}

void finish(AsyncSave::State& s, Millis timeout) {
  if (s.committed) {
    if (s.outcome) std::rethrow_exception(s.outcome);
    return;
  }
  s.committed = true;
  std::string list, error;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    if (s.done.wait_for(lock, timeout, [&] { return s.written; })) {
      list = s.list;
      error = s.error;
    } else {
      // Agreed below, so every rank throws; the writer is joined later, and
      // without a commit its file is never part of a checkpoint.
      error = s.where() + ": the background write did not finish within " +
              std::to_string(timeout.count()) + " ms";
    }
  }
  try {
    commit(s.comm, s.dir, list, error);
  } catch (...) {
    s.outcome = std::current_exception();
    throw;
  }
}

}  // namespace

bool AsyncSave::ready() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->written;
}

void AsyncSave::wait(Millis timeout) {
  if (state_) finish(*state_, timeout);
}

namespace {

// The last save started on `comm` while a handle on it lives (its staging
// memory is reused by the next save there), or null.
std::shared_ptr<AsyncSave::State> last_save(Communicator& comm) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(&comm);
  if (it == registry.end()) return nullptr;
  auto last = it->second.lock();
  if (!last) registry.erase(it);
  return last;
}

}  // namespace

void finish_pending_save(Communicator& comm) {
  // A committed save's error was thrown by its own wait(): not again here.
  if (auto last = last_save(comm); last && !last->committed) finish(*last, kAsyncSaveTimeout);
}

AsyncSave async_save(const StateDict& state, const std::string& dir, Communicator& comm) {
  auto last = last_save(comm);
  if (last && !last->committed) finish(*last, kAsyncSaveTimeout);
  auto s = std::make_shared<AsyncSave::State>(comm, dir);
  // The last save's staging memory, unless its writer still reads it (one
  // that did not finish in time): stage_rank_file checks that nothing else
  // holds the arena before it writes into it.
  if (last) s->arena = std::move(last->arena);
  std::string error = comm.rank() == 0 ? prepare_folder(dir) : "";
  try {
    s->staged = stage_rank_file(state, comm.rank(), comm.size(), &s->arena, "dcp::async_save");
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
  agree(comm, error);
  s->writer = std::thread([raw = s.get()] { write_in_background(*raw); });
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry[&comm] = s;
  }
  return AsyncSave(std::move(s));
}

}  // namespace cohort::dcp
