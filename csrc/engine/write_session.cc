#include "write_session.h"

#include "sys.h"

namespace fastckpt {

WriteSession::WriteSession(Engine& eng, const char* kind_, const std::string& target_, bool owns)
    : engine(eng), cfg(eng.config()), kind(kind_), target(target_), dir(sys::dirname(target_)), owns_temp(owns),
      lease(lease_for(eng, target_)), t0(now_seconds()) {
  if (target.empty() || target.back() == '/')
    throw UsageError(std::string(kind) + ": not a file path: '" + target + "'");
  backend = lease.get().name();
  q.reset(new IoQueue(lease.get(), cfg.queue_depth));
}

void WriteSession::ensure_open() const {
  if (state == State::Open) return;
  const char* now = state == State::Finished ? "finished" : state == State::Committed ? "committed" : "aborted";
  throw UsageError(std::string(kind) + " for " + target + " is already " + now);
}

void WriteSession::sync() {
  sys::fdatasync(fd, tmp);
  sys::close_quiet(fd_direct);
  fd_direct = -1;
  if (!owns_temp) {
    sys::close_quiet(fd);
    fd = -1;
  }
  requeued = q->requeued();
  q.reset();
  bufs.release(engine.pool(), {});
  lease.give_back();
  state = State::Finished;
}

void WriteSession::publish() {
  sys::rename(tmp, target);
  sys::close_quiet(fd);
  fd = -1;
  state = State::Committed;  // renamed: from here on, nothing to remove
  sys::fsync_dir(dir);
}

void WriteSession::abort() noexcept {
  if (state == State::Aborted || state == State::Committed) return;
  state = State::Aborted;
  std::vector<int> unreaped;
  if (q) {
    q->drain();
    unreaped = q->unreaped_buffers();
    if (q->broken()) lease.discard();
    q.reset();
  }
  lease.give_back();  // an aborted writer holds no ring or threads
  bufs.release(engine.pool(), unreaped);
  sys::close_quiet(fd_direct);
  fd_direct = -1;
  sys::close_quiet(fd);
  fd = -1;
  if (owns_temp && !tmp.empty()) sys::unlink_quiet(tmp);
}

bool WriteSession::write_first_direct(const char* buf, uint64_t len, uint64_t off) {
  try {
    sys::pwrite_full(fd_direct >= 0 ? fd_direct : fd, buf, len, static_cast<int64_t>(off), tmp);
    return true;
  } catch (const IoError& e) {
    if (e.err() != EINVAL) throw;
  }
  if (fd_direct >= 0) {
    sys::close_quiet(fd_direct);
    fd_direct = -1;
  } else {
    sys::set_direct(fd, false, tmp);
  }
  direct = false;
  align = 1;
  fallback = "write(O_DIRECT): EINVAL";
  return false;
}

void WriteSession::fill(WriteStatsBase& st) const {
  st.requeued = requeued;
  st.seconds = now_seconds() - t0;
  st.direct = direct;
  st.backend = backend;
  st.alignment = direct ? align : 0;
  st.fallback = fallback;
  st.leftovers_removed = leftovers;
}

}  // namespace fastckpt
