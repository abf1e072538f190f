// The io_uring backend (liburing). Built only when liburing's headers were
// found (FASTCKPT_HAVE_URING); otherwise make_uring_backend reports ENOSYS and
// the engine uses the thread backend.
#include <cerrno>
#include <cstdint>

#include "backend.h"
#include "buffer_pool.h"
#include "error.h"
#include "fault.h"

#ifdef FASTCKPT_HAVE_URING
#include <liburing.h>
#endif

namespace fastckpt {

#ifdef FASTCKPT_HAVE_URING
namespace {

class UringBackend final : public Backend {
 public:
  UringBackend(unsigned depth, BufferPool* pool) : depth_(depth), pool_(pool) {
    fault::Action a = fault::on(fault::Op::UringSetup, "");
    if (a.err) throw_io(a.err, "io_uring_queue_init", "<io_uring>");
    int r = io_uring_queue_init(depth, &ring_, 0);
    if (r < 0) throw_io(-r, "io_uring_queue_init", "<io_uring>");
    if (pool_) {
      // An empty table now; each buffer is registered (and pinned) at its
      // first use on this ring. If the kernel refuses the table, every
      // request is a plain read or write.
      fault::Action f = fault::on(fault::Op::UringRegister, "");
      r = f.err ? -f.err : io_uring_register_buffers_sparse(&ring_, static_cast<unsigned>(pool_->count()));
      if (r == 0) reg_.assign(pool_->count(), kUnknown);
      else pool_->note_registered(-1, false);
    }
  }

  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  const char* name() const override { return "io_uring"; }
  unsigned max_inflight() const override { return depth_; }

  void submit(const IoRequest& req) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {
      flush(req);  // cannot happen with at most depth_ in flight; kept for safety
      sqe = io_uring_get_sqe(&ring_);
      if (!sqe) throw_io(EBUSY, "io_uring_get_sqe", "<io_uring>", req.off, req.len);
    }
    const bool fixed = req.kind != IoRequest::Fsync && !req.iov && usable_fixed(req);
    switch (req.kind) {
      case IoRequest::Write:
        if (fixed)
          io_uring_prep_write_fixed(sqe, req.fd, req.buf, static_cast<unsigned>(req.len), req.off, req.buf_index);
        else
          io_uring_prep_write(sqe, req.fd, req.buf, static_cast<unsigned>(req.len), req.off);
        break;
      case IoRequest::Read:
        if (req.iov)
          io_uring_prep_readv(sqe, req.fd, req.iov, req.iovcnt, req.off);
        else if (fixed)
          io_uring_prep_read_fixed(sqe, req.fd, req.buf, static_cast<unsigned>(req.len), req.off, req.buf_index);
        else
          io_uring_prep_read(sqe, req.fd, req.buf, static_cast<unsigned>(req.len), req.off);
        break;
      case IoRequest::Fsync:
        io_uring_prep_fsync(sqe, req.fd, IORING_FSYNC_DATASYNC);
        break;
    }
    io_uring_sqe_set_data64(sqe, req.tag);
    ++unsubmitted_;
    flush(req);
  }

  IoCompletion wait() override {
    fault::Action a = fault::on(fault::Op::UringWait, "");
    if (a.err) throw_io(a.err, "io_uring_wait_cqe", "<io_uring>");
    io_uring_cqe* cqe = nullptr;
    for (;;) {
      int r = io_uring_wait_cqe(&ring_, &cqe);
      if (r == 0) break;
      if (r == -EINTR || r == -EAGAIN) continue;
      throw_io(-r, "io_uring_wait_cqe", "<io_uring>");
    }
    IoCompletion c{io_uring_cqe_get_data64(cqe), cqe->res};
    io_uring_cqe_seen(&ring_, cqe);
    return c;
  }

 private:
  // Hands every prepared SQE to the kernel. On failure the SQEs stay in the
  // submission queue and the ring's state is unknown: the caller (IoQueue)
  // marks the backend broken and it is never used again.
  void flush(const IoRequest& req) {
    unsigned tries = 0;
    while (unsubmitted_ > 0) {
      fault::Action a = fault::on(fault::Op::UringSubmit, "");
      int r = a.err ? -a.err : io_uring_submit(&ring_);
      if (r > 0) {
        unsubmitted_ -= static_cast<unsigned>(r) < unsubmitted_ ? static_cast<unsigned>(r) : unsubmitted_;
        continue;
      }
      // 0 (nothing taken) or a transient refusal: retry a bounded number of times.
      if ((r == 0 || r == -EINTR || r == -EAGAIN || r == -EBUSY) && ++tries < kMaxSubmitRetries) continue;
      throw_io(r == 0 ? EAGAIN : -r, "io_uring_submit", "<io_uring>", req.off, req.len);
    }
  }

  // Whether `req` can be a fixed-buffer request: its bytes lie in pool buffer
  // req.buf_index, registered with this ring now if it was not yet.
  bool usable_fixed(const IoRequest& req) {
    if (reg_.empty() || req.buf_index < 0 || static_cast<size_t>(req.buf_index) >= reg_.size()) return false;
    const iovec v = pool_->iov(req.buf_index);
    const char* base = static_cast<const char*>(v.iov_base);
    if (req.buf < base || req.buf + req.len > base + v.iov_len) return false;
    uint8_t& state = reg_[static_cast<size_t>(req.buf_index)];
    // Registering pins (and so faults in) the whole buffer: worth it for a
    // transfer that fills most of it, which then saves the kernel pinning its
    // pages per request, not for a small load's records or a small save (a
    // 1 MiB state would fault in all 8 MiB of its buffer: 1.7 ms of a first
    // save of 4 ms here, against some 20 us of pinning its own pages).
    if (state == kUnknown && req.len < v.iov_len / 2) return false;
    if (state == kUnknown) {
      fault::Action f = fault::on(fault::Op::UringRegister, "");
      const int r = f.err ? -f.err
                          : io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(req.buf_index), &v,
                                                                 nullptr, 1);
      state = r == 1 ? kRegistered : kRefused;
      pool_->note_registered(req.buf_index, state == kRegistered);
    }
    return state == kRegistered;
  }

  static constexpr unsigned kMaxSubmitRetries = 100000;
  enum : uint8_t { kUnknown = 0, kRegistered = 1, kRefused = 2 };

  unsigned depth_;
  BufferPool* pool_;
  io_uring ring_{};
  std::vector<uint8_t> reg_;  // per pool buffer, in this ring; empty: no table (no fixed I/O)
  unsigned unsubmitted_ = 0;  // SQEs prepared and not yet taken by the kernel
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned depth, BufferPool* pool) {
  return std::unique_ptr<Backend>(new UringBackend(depth, pool));
}

bool uring_compiled() { return true; }

#else  // !FASTCKPT_HAVE_URING

std::unique_ptr<Backend> make_uring_backend(unsigned, BufferPool*) {
  throw_io(ENOSYS, "io_uring_queue_init", "<fastckpt built without liburing>");
}

bool uring_compiled() { return false; }

#endif

}  // namespace fastckpt
