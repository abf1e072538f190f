#include "region_writer.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "crc32.h"
#include "error.h"
#include "sys.h"
#include "temp_file.h"

namespace fastckpt {

RegionWriter::RegionWriter(Engine& engine, const std::string& target, const std::string& tmp, bool create,
                           uint64_t size)
    : s_(engine, "RegionWriter", target, /*owns_temp=*/create) {
  if (!create && tmp.empty()) throw UsageError("RegionWriter for " + target + ": no temporary file to open");
  if (create && size > static_cast<uint64_t>(INT64_MAX))
    throw UsageError("RegionWriter for " + target + ": size " + std::to_string(size) + " is too large");
  if (create) s_.leftovers = remove_leftovers(target);
  else s_.tmp = tmp;
  s_.guarded([&] {
    if (create) open_create(size);
    else open_existing();
    open_direct();
  });
}

void RegionWriter::open_create(uint64_t size) {
  bool direct = false;  // this descriptor stays buffered; open_direct() makes the O_DIRECT one
  std::string unused;
  s_.fd = create_temp_file(s_.target, &s_.tmp, &direct, &unused);
  if (size > 0) sys::ftruncate(s_.fd, size, s_.tmp);
}

void RegionWriter::open_existing() { s_.fd = sys::open(s_.tmp, O_WRONLY | O_NOFOLLOW); }

void RegionWriter::open_direct() {
  if (!s_.cfg.direct) {
    s_.fallback = "disabled by configuration";
    return;
  }
  try {
    s_.fd_direct = sys::open(s_.tmp, O_WRONLY | O_NOFOLLOW | O_DIRECT);
  } catch (const IoError& e) {
    if (e.err() != EINVAL) throw;
    s_.fallback = "open(O_DIRECT): EINVAL";
    return;
  }
  sys::DioAlign al = sys::dio_alignment(s_.fd_direct, s_.tmp);
  if (!s_.engine.pool().fits_direct_io(al.mem, al.offset)) {
    sys::close_quiet(s_.fd_direct);
    s_.fd_direct = -1;
    s_.fallback = "unsupported direct-I/O alignment " + std::to_string(al.offset);
    return;
  }
  s_.align = al.offset;
  s_.direct = true;
}

int RegionWriter::take_buffer() {
  return s_.bufs.take(s_.engine.pool(), *s_.q, s_.cfg.queue_depth, [this] { reap_one(); });
}

void RegionWriter::reap_one() { s_.bufs.put_back(static_cast<int>(s_.q->reap().tag)); }

void RegionWriter::submit(int buf, uint64_t len, uint64_t off) {
  stream_fence();  // the copy's streamed stores, before the kernel reads the buffer
  char* data = s_.engine.pool().data(buf);
  const bool aligned = s_.direct && off % s_.align == 0 && len % s_.align == 0;
  if (aligned && !probed_) {
    probed_ = true;
    if (s_.write_first_direct(data, len, off)) {  // else buffered from now on, this write too
      ++st_.requests;
      ++st_.direct_requests;
      s_.bufs.put_back(buf);
      return;
    }
  }
  const bool use_direct = s_.direct && off % s_.align == 0 && len % s_.align == 0;
  // Never a buffered write and an O_DIRECT one in flight together: the page
  // cache may hold the file in folios larger than a block, so a buffered write
  // can dirty a folio that a concurrent direct write to a neighbouring block
  // must invalidate; the kernel then fails the file's writeback with EIO
  // ("Page cache invalidation failure on direct I/O"). One after the other is
  // safe: a direct write first flushes the dirty pages of its range.
  if (use_direct != inflight_direct_) {
    s_.reap_all([this] { reap_one(); });
    inflight_direct_ = use_direct;
  }
  while (s_.q->full()) reap_one();
  IoRequest r;
  r.kind = IoRequest::Write;
  r.fd = use_direct ? s_.fd_direct : s_.fd;
  r.buf = data;
  r.len = len;
  r.off = static_cast<int64_t>(off);
  r.buf_index = buf;
  r.tag = static_cast<uint64_t>(buf);
  s_.q->submit(r, &s_.tmp);
  ++st_.requests;
  if (use_direct) ++st_.direct_requests;
}

void RegionWriter::write_at(const void* src, uint64_t n, uint64_t off, uint32_t* crc) {
  s_.ensure_open();
  if (n && !src) throw UsageError("RegionWriter::write_at: null source");
  if (off > static_cast<uint64_t>(INT64_MAX) || n > static_cast<uint64_t>(INT64_MAX) - off)
    throw UsageError("RegionWriter for " + s_.target + ": " + std::to_string(n) + " bytes at offset " +
                     std::to_string(off) + " would pass the largest file offset");
  s_.engine.pool().expect(st_.bytes + n);  // huge staging pages once this writer's share fills one
  s_.guarded([&] {
    const char* p = static_cast<const char*>(src);
    const uint64_t bs = s_.engine.pool().buffer_size();
    while (n > 0) {
      const uint64_t k = std::min(n, bs);
      const int b = take_buffer();
      char* dst = s_.engine.pool().data(b);
      // With a checksum, copy in cache-sized pieces and fold each right away.
      constexpr uint64_t piece = 256u << 10;
      for (uint64_t i = 0; i < k; i += piece) {
        const uint64_t m = std::min(piece, k - i);
        copy_streamed(dst + i, p + i, m);
        if (crc) *crc = crc32(*crc, p + i, m);  // the source's lines, cached by the copy
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
  s_.ensure_open();
  s_.guarded([&] {
    s_.reap_all([this] { reap_one(); });
    s_.sync();
  });
  s_.fill(st_);
  return st_;
}

RegionStats RegionWriter::commit() {
  if (!s_.owns_temp)
    throw UsageError("RegionWriter for " + s_.target + ": only the process that created the file commits it");
  if (s_.state == WriteSession::State::Open) finish();
  if (s_.state != WriteSession::State::Finished) s_.ensure_open();
  s_.guarded([&] { s_.publish(); });
  st_.seconds = now_seconds() - s_.t0;
  return st_;
}

}  // namespace fastckpt
