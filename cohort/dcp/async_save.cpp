// dcp::async_save: the placing, the agreement and the buffers' copy at the
// call; the last save's .metadata, the staging copy and the file on a
// background thread; the version check at wait_staged(); the commit at
// wait() (see async_save.h for why).
#include "cohort/dcp/async_save.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/save_steps.h"

namespace cohort::dcp {
// A chunk copied on the background thread, and the version counter its
// source had at the call.
struct DeferredCopy {
  size_t chunk;
  torch::Tensor source;
  std::string fqn;
  int64_t version;
};

// The save pending on each communicator (collectives are ordered per
// communicator; different communicators save independently), keyed by
// Communicator::lifetime(): a communicator built where a destroyed one was
// has that one's address, but none of its saves.
namespace {
std::mutex registry_mu;
std::map<std::weak_ptr<const void>, std::weak_ptr<AsyncSave::State>,
         std::owner_less<std::weak_ptr<const void>>>
    registry;
}  // namespace

struct AsyncSave::State {
  State(Communicator& c, std::string d)
      : comm(c), alive(c.lifetime()), rank(c.rank()), dir(std::move(d)) {}
  ~State() {
    if (worker.joinable()) worker.join();
  }
  std::string where() const {
    return "dcp::async_save of " + dir + " on rank " + std::to_string(rank);
  }

  // Used only while `alive` has not expired (the communicator may be
  // destroyed before wait(): the worker reads `rank` instead).
  Communicator& comm;
  const std::weak_ptr<const void> alive;  // comm.lifetime()
  const int rank;
  const std::string dir;
  StagedFile staged;
  torch::Tensor arena;  // the staging memory staged.data views; the next save reuses it
  std::vector<DeferredCopy> deferred;
  std::thread worker;
  // Set by the worker, under mu.
  std::mutex mu;
  std::condition_variable done;
  bool copied = false;        // the staging copy has finished
  bool written = false;       // ...and the file (or an error)
  std::string copy_error;     // the copy's error, "" when none
  std::string list;           // the chunk list for commit()
  std::string write_error;    // the write's error, "" when none
  bool last_written = false;  // the last save's .metadata (commits_last)
  std::string last_error;     // ...its error on rank 0, "" when none
  // The last save's commit, when this save's call finished it: its folder
  // and, on rank 0, every rank's chunk list, which the worker merges and
  // writes as its .metadata first. Set before the worker starts.
  bool commits_last = false;
  std::string last_dir;
  std::vector<std::string> last_lists;
  // The caller's thread only.
  bool checked = false;      // wait_staged()'s version check has run
  bool copy_late = false;    // ...or wait_staged() gave up on the copy
  std::string change_error;  // a changed tensor, or the copy's timeout
  bool committed = false;
  std::exception_ptr outcome;
  bool last_settled = false;  // the last save's .metadata write agreed (commits_last)
  std::exception_ptr last_outcome;
  // In the last save's state: the save whose worker writes its .metadata.
  std::shared_ptr<State> committer;
};

namespace {

// The same check the worker makes early; the caller's is the one that
// counts (see async_save.h).
std::string changed_tensor(const AsyncSave::State& s) {
  for (const auto& d : s.deferred) {
    if (d.source._version() != d.version) {
      return s.where() + ": tensor " + d.fqn +
             " was changed in place before its staging copy was done (call "
             "AsyncSave::wait_staged() before the optimizer step or a load): the checkpoint "
             "would not hold one step's state";
    }
  }
  return "";
}

// The last save's .metadata, first: a crash during this save's write leaves
// the last one whole.
void write_last_metadata(AsyncSave::State& s) {
  std::string error;
  if (s.rank == 0) {
    try {
      write_metadata_file(s.last_lists, s.last_dir);
    } catch (const std::exception& e) {
      error = "dcp::async_save of " + s.last_dir + " on rank 0: .metadata: " + e.what();
    }
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.last_written = true;
  s.last_error = std::move(error);
  s.done.notify_all();
}

void copy_and_write(AsyncSave::State& s) {
  if (s.commits_last) write_last_metadata(s);
  std::string error;
  try {
    for (const auto& d : s.deferred) s.staged.data[d.chunk].copy_(d.source);
    error = changed_tensor(s);
  } catch (const std::exception& e) {
    error = s.where() + ": staging copy: " + e.what();
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.copied = true;
    s.copy_error = error;
    s.done.notify_all();
  }
  // The write yields the CPU to the training: where the ranks keep every
  // core busy (a CPU job) its checksums and page-cache copies would
  // otherwise come out of the step time; it runs in the gaps instead, and
  // the next save waits if it has not finished. Best effort: a failure
  // leaves the default priority. (The copy above ran at the default: the
  // optimizer step waits for it.)
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  std::string list;
  if (error.empty()) {
    try {
      list = write_staged_file(s.staged, s.dir, s.rank);
    } catch (const std::exception& e) {
      error = s.where() + ": background write: " + e.what();
    } catch (...) {
      error = s.where() + ": background write: unknown exception";
    }
  }
  s.staged.data.clear();  // the staging memory goes back now, not at wait()
  std::lock_guard<std::mutex> lock(s.mu);
  s.written = true;
  s.list = std::move(list);
  s.write_error = std::move(error);
  s.done.notify_all();
}

// wait_staged() without the throw: false when the copy did not finish in
// time (recorded, so that the commit fails).
bool await_staged(AsyncSave::State& s, Millis timeout) {
  if (s.checked) return !s.copy_late;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    if (!s.done.wait_for(lock, timeout, [&] { return s.copied; })) {
      s.change_error = s.where() + ": the staging copy did not finish within " +
                       std::to_string(timeout.count()) + " ms";
      s.checked = s.copy_late = true;
      return false;
    }
  }
  s.change_error = changed_tensor(s);
  s.checked = true;
  // The sources are no longer needed: the model's tensors are the caller's.
  s.deferred.clear();
  return true;
}

// Collective, where `s` writes the last save's .metadata: waits for that
// write and agrees on its outcome, once (later calls rethrow it).
void settle_last(AsyncSave::State& s, Millis timeout) {
  if (!s.commits_last) return;
  if (s.last_settled) {
    if (s.last_outcome) std::rethrow_exception(s.last_outcome);
    return;
  }
  s.last_settled = true;
  std::string error;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    if (s.done.wait_for(lock, timeout, [&] { return s.last_written; })) {
      error = s.last_error;
    } else {
      error = "dcp::async_save of " + s.last_dir + " on rank " + std::to_string(s.rank) +
              ": its .metadata write did not finish within " + std::to_string(timeout.count()) +
              " ms";
    }
  }
  try {
    agree(s.comm, error);
  } catch (...) {
    s.last_outcome = std::current_exception();
    throw;
  }
}

// Collective: the commit of `s` but rank 0's .metadata: the save before it
// settled, this rank's copy and write waited for, every rank's outcome
// agreed. Returns every rank's chunk list on rank 0 (none elsewhere).
std::vector<std::string> plan_commit(AsyncSave::State& s, Millis timeout) {
  s.committed = true;
  try {
    settle_last(s, timeout);
    const auto start = std::chrono::steady_clock::now();
    await_staged(s, timeout);
    const auto left = std::max(Millis(0), timeout - std::chrono::duration_cast<Millis>(
                                                        std::chrono::steady_clock::now() - start));
    std::string list, error = s.change_error;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      if (s.done.wait_for(lock, left, [&] { return s.written; })) {
        list = s.list;
        if (error.empty()) error = s.copy_error.empty() ? s.write_error : s.copy_error;
      } else if (error.empty()) {
        // Agreed below, so every rank throws; the worker is joined later, and
        // without a commit its file is never part of a checkpoint.
        error = s.where() + ": the background write did not finish within " +
                std::to_string(timeout.count()) + " ms";
      }
    }
    return gather_lists(s.comm, list, error);
  } catch (...) {
    s.outcome = std::current_exception();
    throw;
  }
}

// What is left of wait() is collective: where the communicator is gone,
// every rank throws this, and a second wait() the same.
void require_communicator(AsyncSave::State& s) {
  if (!s.alive.expired()) return;
  const std::string why =
      s.committed ? "its communicator was destroyed before wait(): its .metadata, written on the "
                    "next save's background thread, was never agreed on"
                  : "its communicator was destroyed before wait(): the save was never committed "
                    "(the folder holds no checkpoint)";
  s.outcome = std::make_exception_ptr(CheckpointError(s.where() + ": " + why));
  std::rethrow_exception(s.outcome);
}

void finish(AsyncSave::State& s, Millis timeout) {
  if (s.committed) {
    if (s.outcome) std::rethrow_exception(s.outcome);
    // Committed by the next save's call: its worker writes the .metadata.
    if (auto next = std::move(s.committer)) {
      if (!next->last_settled) require_communicator(s);
      try {
        settle_last(*next, timeout);
      } catch (...) {
        s.outcome = std::current_exception();
        throw;
      }
    }
    return;
  }
  require_communicator(s);
  const auto lists = plan_commit(s, timeout);
  try {
    write_metadata(s.comm, s.dir, lists);
  } catch (...) {
    s.outcome = std::current_exception();
    throw;
  }
}

}  // namespace

bool AsyncSave::staged() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->copied;
}

void AsyncSave::wait_staged(Millis timeout) {
  if (state_ && !state_->committed && !await_staged(*state_, timeout)) {
    throw CheckpointError(state_->change_error);
  }
}

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
  // Dropped: the entries of destroyed communicators and of released saves.
  for (auto it = registry.begin(); it != registry.end();) {
    it = it->first.expired() || it->second.expired() ? registry.erase(it) : std::next(it);
  }
  auto it = registry.find(comm.lifetime());
  return it == registry.end() ? nullptr : it->second.lock();
}

// Tensors copied at the call: the model's buffers, which forward may change
// (BatchNorm's running statistics), and tensors without a version counter
// (inference tensors), whose changes the check could not see. Parameters
// (they require grad) and the optimizer's state change only in the step.
bool copy_at_call(const torch::Tensor& source, const std::string& fqn) {
  if (source.is_inference()) return true;
  return fqn.rfind("model.", 0) == 0 && !source.requires_grad();
}

// `a`, the last save's folder, which exists, and `b`: the same folder under
// any path (a link, "x/../dir"); by the paths where the file system cannot
// tell. Every rank sees the same folders, so decides alike, without a message.
bool same_folder(const std::string& a, const std::string& b) {
  std::error_code ec;
  const bool same = std::filesystem::equivalent(a, b, ec);
  if (!ec) return same;
  auto normal = [](const std::string& dir) {
    auto p = std::filesystem::absolute(dir).lexically_normal();
    return p.has_filename() ? p : p.parent_path();
  };
  return normal(a) == normal(b);
}

// Copies what copy_at_call picks; records the others for the worker.
void split_copies(AsyncSave::State& s) {
  auto& staged = s.staged;
  for (size_t i = 0; i < staged.sources.size(); ++i) {
    const auto& source = staged.sources[i];
    // Detached: the copies are no part of the autograd graph (a view
    // shares its tensor's version counter, so the check still sees changes).
    if (copy_at_call(source, staged.source_fqns[i])) {
      staged.data[i].copy_(source.detach());
    } else {
      s.deferred.push_back({i, source.detach(), staged.source_fqns[i], source._version()});
    }
  }
  staged.sources.clear();
  staged.source_fqns.clear();
}

}  // namespace

void finish_pending_save(Communicator& comm) {
  // A committed save's error was thrown by its own wait(): not again here.
  if (auto last = last_save(comm); last && !last->committed) finish(*last, kAsyncSaveTimeout);
}

void finish_pending_save_into(Communicator& comm, const std::string& dir) {
  auto last = last_save(comm);
  if (last && !last->committed && same_folder(last->dir, dir)) finish(*last, kAsyncSaveTimeout);
}

std::string wait_pending_staging(Communicator& comm) {
  auto last = last_save(comm);
  if (!last) return "";
  // Once: an error agreed before was thrown then, not at every load.
  if (!last->last_settled) settle_last(*last, kAsyncSaveTimeout);
  // A copy that did not finish in time is this rank's alone: returned for
  // the caller's agreement, so that no rank is left in a collective.
  if (last->committed || await_staged(*last, kAsyncSaveTimeout)) return "";
  return last->change_error;
}

AsyncSave async_save(const StateDict& state, const std::string& dir, Communicator& comm) {
  auto last = last_save(comm);
  // The last save's commit. Its .metadata is written by this save's worker
  // (or this call, should this save fail to start), unless this save goes
  // into the same folder, which must lose that .metadata before it changes.
  const bool commits_last = last && !last->committed && !same_folder(last->dir, dir);
  std::vector<std::string> last_lists;
  if (commits_last) {
    last_lists = plan_commit(*last, kAsyncSaveTimeout);
  } else if (last && !last->committed) {
    finish(*last, kAsyncSaveTimeout);
  }
  auto s = std::make_shared<AsyncSave::State>(comm, dir);
  // The last save's staging memory, unless its worker still reads it (one
  // that did not finish in time): stage_rank_file checks that nothing else
  // holds the arena before it writes into it.
  if (last) s->arena = std::move(last->arena);
  std::string error;
  ErrorKind kind = ErrorKind::Checkpoint;
  try {
    StateDict rebuilt;
    const std::string op = "dcp::async_save";  // named: a temporary would read as dangling
    const auto& now = current(state, rebuilt, op, comm.rank());
    for (const auto& f : now.check_model) f(op);
    for (const auto& f : now.refresh) f();
    s->staged = stage_rank_file(now, comm.rank(), comm.size(), &s->arena, op);
    split_copies(*s);
  } catch (const std::exception& e) {
    error = e.what();
    kind = kind_of(e);
  }
  try {
    // The folder only once every rank's checks passed: a save refused on
    // any rank leaves the checkpoint in it as it was.
    agree_on_plan(comm, s->staged.plan, error, kind, "dcp::async_save");
    agree(comm, comm.rank() == 0 ? prepare_folder(dir) : "");
  } catch (const Error&) {
    if (commits_last) {
      try {
        write_metadata(comm, last->dir, last_lists);
      } catch (...) {
        last->outcome = std::current_exception();
        throw;
      }
    }
    throw;
  }
  if (commits_last) {
    s->commits_last = true;
    s->last_dir = last->dir;
    s->last_lists = std::move(last_lists);
    last->committer = s;
  }
  s->worker = std::thread([raw = s.get()] { copy_and_write(*raw); });
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry[comm.lifetime()] = s;
  }
  return AsyncSave(std::move(s));
}

}  // namespace cohort::dcp
