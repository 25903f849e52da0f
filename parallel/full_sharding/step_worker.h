#pragma once
/// Runs full sharding's unit steps one after another on a thread of its own (overlap_step).

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace shampoo::detail {

/// Runs steps one after another on a thread of their own.
class StepWorker {
 public:
  StepWorker() : thread_([this] { run(); }) {}
  ~StepWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  StepWorker(const StepWorker&) = delete;
  StepWorker& operator=(const StepWorker&) = delete;

  std::shared_future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    auto future = packaged.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(packaged));
    }
    ready_.notify_one();
    return future;
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();  // an exception lands in the task's future
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace shampoo::detail
