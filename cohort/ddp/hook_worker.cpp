#include "cohort/ddp/hook_worker.h"

#include <ATen/Parallel.h>

#include <chrono>

#include "cohort/core/error.h"
#include "cohort/core/job_work.h"

namespace cohort {

HookWorker::HookWorker() : thread_([this] { loop(); }) {}

HookWorker::~HookWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HookWorker::loop() {
  // The process-wide intra-op thread count (torch::set_num_threads) is
  // per-thread state under OpenMP: take it over, as autograd's threads do.
  at::init_num_threads();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    idle_.notify_all();
  }
}

Work HookWorker::submit(OpContext context, std::function<void()> job) {
  auto work = std::make_shared<JobWork>(context.op);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back([this, work, op = context.op, job = std::move(job)] {
      std::string earlier;
      {
        std::lock_guard<std::mutex> lock(mu_);
        earlier = failure_;
      }
      if (!earlier.empty()) {
        work->finish(std::make_exception_ptr(
            PeerError(op + ": refused, an earlier job of this hook failed: " + earlier)));
        return;
      }
      try {
        job();
        work->finish(nullptr);
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          failure_ = e.what();
        }
        work->finish(std::current_exception());
      }
    });
  }
  wake_.notify_one();
  return Work(std::move(work), std::move(context));
}

void HookWorker::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return queue_.empty() && !running_; });
}

}  // namespace cohort
