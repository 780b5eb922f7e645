#include "cohort/core/serial_worker.h"

namespace cohort {

SerialWorker::SerialWorker(Options options)
    : options_(std::move(options)), thread_([this] { loop(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake();
  thread_.join();
}

void SerialWorker::wake() {
  if (options_.idle) {
    if (options_.wake) options_.wake();
  } else {
    wake_.notify_all();
  }
}

void SerialWorker::loop() {
  if (options_.on_start) options_.on_start();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!options_.idle) {
        wake_.wait(lock, [&] { return stopping_ || (!busy_ && !queue_.empty()); });
      }
      if (!busy_ && !queue_.empty()) {
        job = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      } else if (stopping_ && queue_.empty()) {
        return;
      }
    }
    if (!job) {
      options_.idle();
      continue;
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    idle_.notify_all();
  }
}

std::shared_ptr<WorkImpl> SerialWorker::submit(std::string what, Clock::time_point deadline,
                                               std::function<void()> job, Millis grace) {
  auto work = std::make_shared<JobWork>(what, deadline, grace);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back([this, work, what = std::move(what), job = std::move(job)]() mutable {
      work->finish(guarded(what, job));
    });
  }
  wake();
  return work;
}

void SerialWorker::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

}  // namespace cohort
