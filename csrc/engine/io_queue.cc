#include "io_queue.h"

#include <algorithm>
#include <cerrno>

#include "error.h"
#include "fault.h"

namespace fastckpt {
namespace {
constexpr unsigned kMaxRetries = 100000;  // EINTR/EAGAIN/short-transfer storms

fault::Op fault_op(IoRequest::Kind k) {
  switch (k) {
    case IoRequest::Write: return fault::Op::Write;
    case IoRequest::Read: return fault::Op::Read;
    case IoRequest::Fsync: return fault::Op::Fsync;
  }
  return fault::Op::Write;
}

const char* op_name(IoRequest::Kind k) {
  switch (k) {
    case IoRequest::Write: return "pwrite";
    case IoRequest::Read: return "pread";
    case IoRequest::Fsync: return "fdatasync";
  }
  return "?";
}
}  // namespace

IoQueue::IoQueue(Backend& backend, unsigned max_inflight)
    : be_(backend), max_inflight_(max_inflight ? max_inflight : 1) {
  if (max_inflight_ > be_.max_inflight()) max_inflight_ = be_.max_inflight();
  slots_.resize(max_inflight_);
  for (int i = static_cast<int>(max_inflight_) - 1; i >= 0; --i) free_slots_.push_back(i);
}

IoQueue::~IoQueue() { drain(); }

void IoQueue::submit(const IoRequest& req, const std::string* path, uint64_t min_len) {
  if (free_slots_.empty()) throw UsageError("IoQueue::submit: queue is full");
  int s = free_slots_.back();
  free_slots_.pop_back();
  Slot& sl = slots_[s];
  sl.req = req;
  sl.iov.assign(req.iov, req.iov + (req.iov ? req.iovcnt : 0));
  sl.path = path;
  sl.done = 0;
  sl.min_len = min_len > req.len ? req.len : min_len;
  sl.retries = 0;
  sl.busy = true;
  ++inflight_;
  issue(s);
}

void IoQueue::issue(int s) {
  Slot& sl = slots_[s];
  IoRequest r = sl.req;
  r.buf = sl.req.buf ? sl.req.buf + sl.done : nullptr;
  r.off = sl.req.off + static_cast<int64_t>(sl.done);
  r.len = sl.req.len - sl.done;
  r.tag = static_cast<uint64_t>(s);
  fault::Action a = fault::on(fault_op(r.kind), *sl.path);
  if (a.err) {
    injected_.push_back(IoCompletion{r.tag, -static_cast<int64_t>(a.err)});
    return;
  }
  if (a.short_len >= 0 && r.kind != IoRequest::Fsync && static_cast<uint64_t>(a.short_len) < r.len) {
    if (a.short_len == 0) {
      injected_.push_back(IoCompletion{r.tag, 0});
      return;
    }
    r.len = static_cast<uint64_t>(a.short_len);
  }
  if (!sl.iov.empty()) {  // what is left of the segments after `done` bytes, at most r.len of them
    sl.cur.clear();
    uint64_t skip = sl.done, room = r.len;
    for (const iovec& v : sl.iov) {
      if (room == 0) break;
      if (skip >= v.iov_len) {
        skip -= v.iov_len;
        continue;
      }
      const uint64_t n = std::min<uint64_t>(v.iov_len - skip, room);
      sl.cur.push_back(iovec{static_cast<char*>(v.iov_base) + skip, n});
      skip = 0;
      room -= n;
    }
    r.iov = sl.cur.data();
    r.iovcnt = static_cast<unsigned>(sl.cur.size());
    r.buf = nullptr;
  }
  try {
    be_.submit(r);
  } catch (...) {
    // The request never reached the kernel, and the backend's state is
    // unknown (an io_uring SQE may still sit in the submission queue): never
    // use it again. Reap what the kernel has before the caller frees buffers.
    broken_ = true;
    release(s);
    drain();
    throw;
  }
  sl.in_backend = true;
  ++in_backend_;
}

IoCompletion IoQueue::next_completion() {
  if (!injected_.empty()) {
    IoCompletion c = injected_.front();
    injected_.pop_front();
    return c;
  }
  IoCompletion c;
  try {
    c = be_.wait();
  } catch (...) {
    broken_ = true;
    throw;
  }
  --in_backend_;
  if (c.tag < slots_.size()) slots_[c.tag].in_backend = false;
  return c;
}

void IoQueue::release(int s) {
  slots_[s].busy = false;
  free_slots_.push_back(s);
  --inflight_;
}

void IoQueue::fail(int s, int err) {
  Slot& sl = slots_[s];
  std::string path = *sl.path;
  IoRequest::Kind kind = sl.req.kind;
  const char* op = sl.iov.empty() ? op_name(kind) : "preadv";
  int64_t off = sl.req.off + static_cast<int64_t>(sl.done);
  uint64_t len = sl.req.len - sl.done;
  release(s);
  drain();
  throw_io(err, op, path, kind == IoRequest::Fsync ? -1 : off, len);
}

Reaped IoQueue::reap() {
  if (inflight_ == 0) throw UsageError("IoQueue::reap: nothing in flight");
  for (;;) {
    IoCompletion c = next_completion();
    int s = static_cast<int>(c.tag);
    Slot& sl = slots_[s];
    if (c.res == -EINTR || c.res == -EAGAIN) {
      if (++sl.retries > kMaxRetries) fail(s, static_cast<int>(-c.res));
      ++requeued_;
      issue(s);
      continue;
    }
    if (c.res < 0) fail(s, static_cast<int>(-c.res));
    if (sl.req.kind == IoRequest::Fsync) {
      Reaped out{sl.req.tag, 0};
      release(s);
      return out;
    }
    if (c.res == 0 && sl.done < sl.req.len) {
      if (sl.req.kind == IoRequest::Read && sl.done >= sl.min_len) {
        Reaped out{sl.req.tag, sl.done};  // end of file after everything needed
        release(s);
        return out;
      }
      if (sl.req.kind == IoRequest::Read) {
        std::string path = *sl.path;
        int64_t off = sl.req.off;
        uint64_t need = sl.min_len, done = sl.done;
        release(s);
        drain();
        throw TruncatedError(path, static_cast<uint64_t>(off), need, static_cast<uint64_t>(off) + done);
      }
      fail(s, EIO);  // a write that makes no progress
    }
    sl.done += static_cast<uint64_t>(c.res);
    if (sl.done >= sl.req.len) {
      Reaped out{sl.req.tag, sl.done};
      release(s);
      return out;
    }
    // Short transfer: requeue the rest.
    if (++sl.retries > kMaxRetries) fail(s, EIO);
    ++requeued_;
    issue(s);
  }
}

void IoQueue::drain() noexcept {
  injected_.clear();
  while (in_backend_ > 0) {
    try {
      IoCompletion c = be_.wait();
      --in_backend_;
      if (c.tag < slots_.size()) slots_[c.tag].in_backend = false;
    } catch (...) {
      // Completions can no longer be reaped: what the kernel still holds is lost.
      broken_ = true;
      for (Slot& sl : slots_) {
        if (!sl.in_backend) continue;
        sl.in_backend = false;
        if (sl.req.buf_index >= 0) unreaped_.push_back(sl.req.buf_index);
      }
      in_backend_ = 0;
      break;
    }
  }
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].busy) release(static_cast<int>(i));
}

}  // namespace fastckpt
