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

// What the workers share, on the heap: a forked child leaks it (see below).
struct Shared {
  std::mutex mu;
  std::condition_variable req_cv, done_cv;
  std::deque<IoRequest> requests;
  std::deque<IoCompletion> done;
  std::vector<std::thread> workers;
  bool stop = false;
};

class ThreadBackend final : public Backend {
 public:
  ThreadBackend(unsigned threads, unsigned depth) : depth_(depth), pid_(::getpid()), s_(new Shared) {
    s_->workers.reserve(threads);
    Shared* s = s_;
    for (unsigned i = 0; i < threads; ++i) s_->workers.emplace_back([s] { run(s); });
  }

  ~ThreadBackend() override {
    if (::getpid() != pid_) {
      // Destroyed in a forked child: the workers exist only in the parent.
      // Joining them, taking a mutex a parent's thread may have held at
      // fork(), or destroying a condition variable the parent's threads were
      // waiting on (glibc waits for them) would hang: leave it all alone.
      return;
    }
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      s_->stop = true;
    }
    s_->req_cv.notify_all();
    for (auto& t : s_->workers) t.join();
    delete s_;
  }

  const char* name() const override { return "threads"; }
  unsigned max_inflight() const override { return depth_; }

  void submit(const IoRequest& req) override {
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      s_->requests.push_back(req);
    }
    s_->req_cv.notify_one();
  }

  IoCompletion wait() override {
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->done_cv.wait(lk, [&] { return !s_->done.empty(); });
    IoCompletion c = s_->done.front();
    s_->done.pop_front();
    return c;
  }

 private:
  static void run(Shared* s) {
    for (;;) {
      IoRequest r;
      {
        std::unique_lock<std::mutex> lk(s->mu);
        s->req_cv.wait(lk, [&] { return s->stop || !s->requests.empty(); });
        if (s->requests.empty()) return;  // stop and nothing left
        r = s->requests.front();
        s->requests.pop_front();
      }
      int64_t res = 0;
      switch (r.kind) {
        case IoRequest::Write: res = sys::pwrite_raw(r.fd, r.buf, r.len, r.off); break;
        case IoRequest::Read: res = sys::pread_raw(r.fd, r.buf, r.len, r.off); break;
        case IoRequest::Fsync: res = sys::fdatasync_raw(r.fd); break;
      }
      {
        std::lock_guard<std::mutex> lk(s->mu);
        s->done.push_back(IoCompletion{r.tag, res});
      }
      s->done_cv.notify_one();
    }
  }

  unsigned depth_;
  pid_t pid_;  // the process whose threads these are
  Shared* s_;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(unsigned threads, unsigned depth) {
  return std::unique_ptr<Backend>(new ThreadBackend(threads, depth));
}

}  // namespace fastckpt
