// The pwrite/pread thread-pool backend: each worker performs one system call
// per request and posts the result; IoQueue handles what the result means.
// Workers are started as requests need them (a request queued while no
// worker is idle starts one, up to `threads`), so a small load that keeps one
// request in flight starts one thread, not the whole pool.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "backend.h"
#include "error.h"
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
  unsigned idle = 0;  // workers waiting for a request
  bool stop = false;
};

class ThreadBackend final : public Backend {
 public:
  ThreadBackend(unsigned threads, unsigned depth)
      : threads_(threads ? threads : 1), depth_(depth), pid_(::getpid()), s_(new Shared) {
    s_->workers.reserve(threads_);
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
      // More queued requests than idle workers to take them: one more worker.
      // If no thread can be made, the request waits for the workers there
      // are; with none, it is taken back and the failure reported (IoQueue
      // then never uses this backend again).
      if (s_->requests.size() > s_->idle && s_->workers.size() < threads_) {
        Shared* s = s_;
        try {
          s_->workers.emplace_back([s] { run(s); });
        } catch (const std::system_error& e) {
          if (s_->workers.empty()) {
            s_->requests.pop_back();
            throw_io(e.code().value() ? e.code().value() : EAGAIN, "pthread_create", "<fastckpt I/O threads>");
          }
        }
      }
    }
    s_->req_cv.notify_one();
  }

  unsigned threads_started() const override {
    std::lock_guard<std::mutex> lk(s_->mu);
    return static_cast<unsigned>(s_->workers.size());
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
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      // Idle from the moment its last completion is posted (same critical
      // section), so that a caller that submits again after seeing it finds
      // this worker idle and starts no other.
      ++s->idle;
      s->req_cv.wait(lk, [&] { return s->stop || !s->requests.empty(); });
      --s->idle;
      if (s->requests.empty()) return;  // stop and nothing left
      IoRequest r = s->requests.front();
      s->requests.pop_front();
      lk.unlock();
      int64_t res = 0;
      switch (r.kind) {
        case IoRequest::Write: res = sys::pwrite_raw(r.fd, r.buf, r.len, r.off); break;
        case IoRequest::Read:
          res = r.iov ? sys::preadv_raw(r.fd, r.iov, static_cast<int>(r.iovcnt), r.off)
                      : sys::pread_raw(r.fd, r.buf, r.len, r.off);
          break;
        case IoRequest::Fsync: res = sys::fdatasync_raw(r.fd); break;
      }
      lk.lock();
      s->done.push_back(IoCompletion{r.tag, res});
      s->done_cv.notify_one();
    }
  }

  unsigned threads_;  // at most this many workers
  unsigned depth_;
  pid_t pid_;  // the process whose threads these are
  Shared* s_;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(unsigned threads, unsigned depth) {
  return std::unique_ptr<Backend>(new ThreadBackend(threads, depth));
}

}  // namespace fastckpt
