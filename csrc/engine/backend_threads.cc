// The pwrite/pread thread-pool backend: each worker performs one system call
// per request and posts the result; IoQueue handles what the result means.
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "backend.h"
#include "sys.h"

namespace fastckpt {
namespace {

class ThreadBackend final : public Backend {
 public:
  ThreadBackend(unsigned threads, unsigned depth) : depth_(depth), pid_(::getpid()) {
    workers_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  ~ThreadBackend() override {
    if (::getpid() != pid_) {
      // Destroyed in a forked child: the workers exist only in the parent, and
      // mu_ may have been held there at fork(). Joining would hang; leave the
      // (copied) thread handles alone.
      new std::vector<std::thread>(std::move(workers_));
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    req_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  const char* name() const override { return "threads"; }
  unsigned max_inflight() const override { return depth_; }

  void submit(const IoRequest& req) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      requests_.push_back(req);
    }
    req_cv_.notify_one();
  }

  IoCompletion wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return !done_.empty(); });
    IoCompletion c = done_.front();
    done_.pop_front();
    return c;
  }

 private:
  void run() {
    for (;;) {
      IoRequest r;
      {
        std::unique_lock<std::mutex> lk(mu_);
        req_cv_.wait(lk, [&] { return stop_ || !requests_.empty(); });
        if (requests_.empty()) return;  // stop_ and nothing left
        r = requests_.front();
        requests_.pop_front();
      }
      int64_t res = 0;
      switch (r.kind) {
        case IoRequest::Write: res = sys::pwrite_raw(r.fd, r.buf, r.len, r.off); break;
        case IoRequest::Read: res = sys::pread_raw(r.fd, r.buf, r.len, r.off); break;
        case IoRequest::Fsync: res = sys::fdatasync_raw(r.fd); break;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        done_.push_back(IoCompletion{r.tag, res});
      }
      done_cv_.notify_one();
    }
  }

  unsigned depth_;
  std::mutex mu_;
  std::condition_variable req_cv_, done_cv_;
  std::deque<IoRequest> requests_;
  std::deque<IoCompletion> done_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  pid_t pid_;  // the process whose threads these are
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(unsigned threads, unsigned depth) {
  return std::unique_ptr<Backend>(new ThreadBackend(threads, depth));
}

}  // namespace fastckpt
