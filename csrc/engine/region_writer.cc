#include "region_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "error.h"
#include "temp_file.h"

namespace fastckpt {

// Runs f; on any error aborts this writer and rethrows (an IoError naming the target).
template <class F>
auto RegionWriter::guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const IoError& e) {
    abort();
    throw e.saving(target_);
  } catch (...) {
    abort();
    throw;
  }
}

RegionWriter::RegionWriter(Engine& engine, const std::string& target, const std::string& tmp, bool create,
                           uint64_t size)
    : eng_(engine), cfg_(engine.config()), target_(target), dir_(sys::dirname(target)),
      lease_(lease_for(engine, target)), owner_(create) {
  t0_ = now_seconds();
  if (target.empty() || target.back() == '/') throw UsageError("RegionWriter: not a file path: '" + target + "'");
  if (!create && tmp.empty()) throw UsageError("RegionWriter for " + target + ": no temporary file to open");
  if (create && size > static_cast<uint64_t>(INT64_MAX))
    throw UsageError("RegionWriter for " + target + ": size " + std::to_string(size) + " is too large");
  backend_ = lease_.get().name();
  q_.reset(new IoQueue(lease_.get(), cfg_.queue_depth));
  if (create) leftovers_ = remove_leftovers(target_);
  else tmp_ = tmp;
  guarded([&] {
    if (create) open_create(size);
    else open_existing();
    open_direct();
  });
}

void RegionWriter::open_create(uint64_t size) {
  bool direct = false;  // this descriptor stays buffered; open_direct() makes the O_DIRECT one
  std::string unused;
  fd_ = create_temp_file(target_, &tmp_, &direct, &unused);
  if (size > 0) sys::ftruncate(fd_, size, tmp_);
}

void RegionWriter::open_existing() { fd_ = sys::open(tmp_, O_WRONLY | O_NOFOLLOW); }

void RegionWriter::open_direct() {
  if (!cfg_.direct) {
    fallback_ = "disabled by configuration";
    return;
  }
  try {
    fdd_ = sys::open(tmp_, O_WRONLY | O_NOFOLLOW | O_DIRECT);
  } catch (const IoError& e) {
    if (e.err() != EINVAL) throw;
    fallback_ = "open(O_DIRECT): EINVAL";
    return;
  }
  sys::DioAlign al = sys::dio_alignment(fdd_, tmp_);
  const uint64_t bs = eng_.pool().buffer_size();
  if (al.mem > 4096 || al.offset > bs || bs % al.offset != 0) {
    sys::close_quiet(fdd_);
    fdd_ = -1;
    fallback_ = "unsupported direct-I/O alignment " + std::to_string(al.offset);
    return;
  }
  align_ = al.offset;
  direct_ = true;
}

RegionWriter::~RegionWriter() {
  if (state_ == State::Open || (state_ == State::Finished && owner_)) abort();
}

void RegionWriter::ensure_open() const {
  if (state_ != State::Open)
    throw UsageError("RegionWriter for " + target_ + " is already " +
                     (state_ == State::Finished ? "finished" : state_ == State::Committed ? "committed" : "aborted"));
}

int RegionWriter::take_buffer() {
  return bufs_.take(eng_.pool(), *q_, cfg_.queue_depth, [this] { reap_one(); });
}

void RegionWriter::reap_one() { bufs_.put_back(static_cast<int>(q_->reap().tag)); }

void RegionWriter::submit(int buf, uint64_t len, uint64_t off) {
  char* data = eng_.pool().data(buf);
  const bool aligned = direct_ && off % align_ == 0 && len % align_ == 0;
  if (aligned && !probed_) {
    // The first direct write, done synchronously: some filesystems accept
    // O_DIRECT at open and refuse it at the first write (EINVAL).
    probed_ = true;
    try {
      sys::pwrite_full(fdd_, data, len, static_cast<int64_t>(off), tmp_);
      ++st_.requests;
      ++st_.direct_requests;
      bufs_.put_back(buf);
      return;
    } catch (const IoError& e) {
      if (e.err() != EINVAL) throw;
      sys::close_quiet(fdd_);
      fdd_ = -1;
      direct_ = false;
      align_ = 0;
      fallback_ = "write(O_DIRECT): EINVAL";
    }
  }
  const bool use_direct = direct_ && off % align_ == 0 && len % align_ == 0;
  while (q_->full()) reap_one();
  IoRequest r;
  r.kind = IoRequest::Write;
  r.fd = use_direct ? fdd_ : fd_;
  r.buf = data;
  r.len = len;
  r.off = static_cast<int64_t>(off);
  r.buf_index = buf;
  r.tag = static_cast<uint64_t>(buf);
  q_->submit(r, &tmp_);
  ++st_.requests;
  if (use_direct) ++st_.direct_requests;
}

void RegionWriter::write_at(const void* src, uint64_t n, uint64_t off, uint32_t* crc) {
  ensure_open();
  if (n && !src) throw UsageError("RegionWriter::write_at: null source");
  if (off > static_cast<uint64_t>(INT64_MAX) || n > static_cast<uint64_t>(INT64_MAX) - off)
    throw UsageError("RegionWriter for " + target_ + ": " + std::to_string(n) + " bytes at offset " +
                     std::to_string(off) + " would pass the largest file offset");
  guarded([&] {
    const char* p = static_cast<const char*>(src);
    const uint64_t bs = eng_.pool().buffer_size();
    while (n > 0) {
      const uint64_t k = std::min(n, bs);
      const int b = take_buffer();
      char* dst = eng_.pool().data(b);
      // With a checksum, copy in cache-sized pieces and fold each right away.
      constexpr uint64_t piece = 256u << 10;
      for (uint64_t i = 0; i < k; i += piece) {
        const uint64_t m = std::min(piece, k - i);
        std::memcpy(dst + i, p + i, m);
        if (crc) *crc = crc32(*crc, dst + i, m);
      }
      submit(b, k, off);
      st_.bytes += k;
      p += k;
      off += k;
      n -= k;
    }
  });
}

RegionStats RegionWriter::finish() {
  ensure_open();
  guarded([&] {
    while (q_->inflight() > 0) reap_one();
    sys::fdatasync(fd_, tmp_);
  });
  if (fdd_ >= 0) sys::close_quiet(fdd_);
  fdd_ = -1;
  if (!owner_) {
    sys::close_quiet(fd_);
    fd_ = -1;
  }
  st_.requeued = q_->requeued();
  q_.reset();
  release_buffers();
  lease_.give_back();
  state_ = State::Finished;
  st_.seconds = now_seconds() - t0_;
  st_.direct = direct_;
  st_.backend = backend_;
  st_.alignment = direct_ ? align_ : 0;
  st_.fallback = fallback_;
  st_.leftovers_removed = leftovers_;
  return st_;
}

RegionStats RegionWriter::commit() {
  if (!owner_) throw UsageError("RegionWriter for " + target_ + ": only the process that created the file commits it");
  if (state_ == State::Open) finish();
  if (state_ != State::Finished) ensure_open();
  guarded([&] {
    // Renamed while still open (and locked), as the Writer does.
    sys::rename(tmp_, target_);
    sys::close_quiet(fd_);
    fd_ = -1;
    state_ = State::Committed;
    sys::fsync_dir(dir_);
  });
  st_.seconds = now_seconds() - t0_;
  return st_;
}

void RegionWriter::release_buffers(const std::vector<int>& unreaped) noexcept {
  bufs_.release(eng_.pool(), unreaped);
}

void RegionWriter::abort() noexcept {
  if (state_ == State::Aborted || state_ == State::Committed) return;
  state_ = State::Aborted;
  std::vector<int> unreaped;
  if (q_) {
    q_->drain();
    unreaped = q_->unreaped_buffers();
    if (q_->broken()) lease_.discard();
    q_.reset();
  }
  lease_.give_back();
  release_buffers(unreaped);
  if (fdd_ >= 0) sys::close_quiet(fdd_);
  fdd_ = -1;
  sys::close_quiet(fd_);
  fd_ = -1;
  if (owner_ && !tmp_.empty()) sys::unlink_quiet(tmp_);
}

}  // namespace fastckpt
