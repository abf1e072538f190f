#include "writer.h"

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

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The tag of a write straight from a caller's memory (no staging buffer to
// give back); the flush's is UINT64_MAX.
static constexpr uint64_t kBorrowedTag = UINT64_MAX - 1;

Writer::Writer(Engine& engine, const std::string& path, int64_t expected_size)
    : s_(engine, "Writer", path, /*owns_temp=*/true) {
  // What crashed saves of this same target left here (docs/ENGINE.md).
  s_.leftovers = remove_leftovers(path);
  s_.guarded([&] { open_temp(expected_size); });
  next_flush_ = s_.cfg.flush_interval;
}

// Creates the temporary file (temp_file.h create_temp_file: O_EXCL, no
// links followed, locked until the rename), O_DIRECT when configured and
// accepted (and usable with the staging buffers' size), and preallocates it.
// Sets the session's tmp only once the file is ours.
void Writer::open_temp(int64_t expected_size) {
  if (expected_size > 0) expected_ = static_cast<uint64_t>(expected_size);
  s_.direct = s_.cfg.direct;
  if (!s_.direct) s_.fallback = "disabled by configuration";
  s_.fd = create_temp_file(s_.target, &s_.tmp, &s_.direct, &s_.fallback);
  if (s_.direct) {
    sys::DioAlign al = sys::dio_alignment(s_.fd, s_.tmp);
    if (!s_.engine.pool().fits_direct_io(al.mem, al.offset)) {
      sys::set_direct(s_.fd, false, s_.tmp);
      s_.direct = false;
      s_.fallback = "unsupported direct-I/O alignment " + std::to_string(al.offset);
    } else {
      s_.align = al.offset;
      mem_align_ = al.mem ? al.mem : al.offset;
      probe_ = true;  // the first write tells whether O_DIRECT writes work (write_first)
    }
  }
  if (expected_size > 0 && s_.cfg.preallocate) {
    if (sys::fallocate(s_.fd, round_up(static_cast<uint64_t>(expected_size), s_.align), s_.tmp))
      size_may_differ_ = true;
  }
}

int Writer::take_buffer() {
  // Huge pages for the staging buffers once a save fills one (BufferPool::
  // expect): by its size when the caller said it, else by what it has written.
  s_.engine.pool().expect(std::max(expected_, pos_));
  return s_.bufs.take(s_.engine.pool(), *s_.q, s_.cfg.queue_depth, [this] { reap_one(); });
}

void Writer::reap_one() {
  Reaped r = s_.q->reap();
  if (r.tag == UINT64_MAX) {
    flush_inflight_ = false;
    return;
  }
  done_bytes_ += r.bytes;
  if (r.tag != kBorrowedTag) s_.bufs.put_back(static_cast<int>(r.tag));
  if (s_.cfg.flush_interval && !flush_inflight_ && done_bytes_ >= next_flush_ && !s_.q->full()) {
    IoRequest f;
    f.kind = IoRequest::Fsync;
    f.fd = s_.fd;
    f.tag = UINT64_MAX;
    s_.q->submit(f, &s_.tmp);
    flush_inflight_ = true;
    next_flush_ = done_bytes_ + s_.cfg.flush_interval;
  }
}

bool Writer::write_first(const char* buf, uint64_t len, uint64_t off) {
  if (!probe_) return false;
  probe_ = false;
  if (!s_.write_first_direct(buf, len, off)) sys::pwrite_full(s_.fd, buf, len, static_cast<int64_t>(off), s_.tmp);
  ++requests_;
  done_bytes_ += len;
  return true;
}

void Writer::submit_current(uint64_t len) {
  stream_fence();  // the copy's streamed stores, before the kernel reads the buffer
  if (write_first(s_.engine.pool().data(cur_), len, buf_off_)) {
    s_.bufs.put_back(cur_);
    cur_ = -1;
    buf_off_ += fill_;
    fill_ = 0;
    return;
  }
  while (s_.q->full()) reap_one();
  IoRequest r;
  r.kind = IoRequest::Write;
  r.fd = s_.fd;
  r.buf = s_.engine.pool().data(cur_);
  r.len = len;
  r.off = static_cast<int64_t>(buf_off_);
  r.buf_index = cur_;
  r.tag = static_cast<uint64_t>(cur_);
  s_.q->submit(r, &s_.tmp);
  ++requests_;
  cur_ = -1;
  buf_off_ += fill_;
  fill_ = 0;
}

void Writer::put(const char* src, uint64_t n, uint32_t* crc) {
  s_.ensure_open();
  if (n > static_cast<uint64_t>(INT64_MAX) - pos_)
    throw UsageError("Writer for " + s_.target + ": " + std::to_string(n) + " bytes at offset " +
                     std::to_string(pos_) + " would pass the largest file offset");
  const uint64_t bs = s_.engine.pool().buffer_size();
  // With a checksum, copy in pieces small enough to still be in the cache
  // when the CRC reads them back.
  const uint64_t piece = crc ? (256u << 10) : bs;
  s_.guarded([&] {
    while (n > 0) {
      if (cur_ < 0) cur_ = take_buffer();
      uint64_t k = bs - fill_ < n ? bs - fill_ : n;
      if (k > piece) k = piece;
      char* dst = s_.engine.pool().data(cur_) + fill_;
      if (src) {
        copy_streamed(dst, src, k);
        if (crc) *crc = crc32(*crc, src, k);  // the source's lines, cached by the copy
        src += k;
      } else {
        std::memset(dst, 0, k);
        if (crc) *crc = crc32(*crc, dst, k);
      }
      fill_ += k;
      pos_ += k;
      n -= k;
      if (fill_ == bs) submit_current(bs);
    }
  });
}

void Writer::append(const void* src, uint64_t n, uint32_t* crc) {
  if (n && !src) throw UsageError("Writer::append: null source");
  put(static_cast<const char*>(src), n, crc);
}

void Writer::append_zeros(uint64_t n) { put(nullptr, n, nullptr); }

void Writer::submit_borrowed(const char* src, uint64_t len) {
  if (write_first(src, len, pos_)) {
    borrowed_bytes_ += len;
    pos_ += len;
    buf_off_ = pos_;
    return;
  }
  while (s_.q->full()) reap_one();
  IoRequest r;
  r.kind = IoRequest::Write;
  r.fd = s_.fd;
  r.buf = const_cast<char*>(src);  // written from, never into
  r.len = len;
  r.off = static_cast<int64_t>(pos_);
  r.buf_index = -1;
  r.tag = kBorrowedTag;
  s_.q->submit(r, &s_.tmp);
  ++requests_;
  borrowed_bytes_ += len;
  pos_ += len;
  buf_off_ = pos_;
}

void Writer::append_borrowed(const void* src_v, uint64_t n, uint32_t* crc) {
  if (n && !src_v) throw UsageError("Writer::append_borrowed: null source");
  const char* src = static_cast<const char*>(src_v);
  const uint64_t a = s_.align > mem_align_ ? s_.align : mem_align_;  // both powers of two
  const uint64_t bs = s_.engine.pool().buffer_size();
  s_.ensure_open();
  // Worth it from a few blocks on (each request pins its pages); elsewhere the copy.
  if (!s_.direct || n < 8 * a || n > static_cast<uint64_t>(INT64_MAX) - pos_ ||
      (reinterpret_cast<uintptr_t>(src) - pos_) % a != 0) {
    put(src, n, crc);
    return;
  }
  const uint64_t head = (a - pos_ % a) % a;
  put(src, head, crc);  // the current buffer now ends on a block boundary
  src += head;
  n -= head;
  const uint64_t body = n / a * a;
  s_.guarded([&] {
    // The staged bytes before the body: a whole number of blocks from buf_off_.
    if (cur_ >= 0 && fill_ > 0) submit_current(fill_);
    for (uint64_t done = 0; done < body;) {
      const uint64_t k = body - done < bs ? body - done : bs;
      submit_borrowed(src + done, k);
      if (crc) *crc = crc32(*crc, src + done, k);  // while the device writes it
      done += k;
    }
  });
  put(src + body, n - body, crc);
}

void Writer::drain() {
  s_.ensure_open();
  s_.guarded([&] { s_.reap_all([this] { reap_one(); }); });
}

void Writer::write_at(const void* src, uint64_t n, uint64_t off) {
  s_.ensure_open();
  if (off > static_cast<uint64_t>(INT64_MAX))
    throw UsageError("Writer::write_at: offset " + std::to_string(off) + " is beyond the largest file offset");
  if (off < pos_)
    throw UsageError("Writer::write_at: offset " + std::to_string(off) + " is behind the current position " +
                     std::to_string(pos_) + " (regions must be written in increasing order)");
  append_zeros(off - pos_);
  append(src, n);
}

WriteStats Writer::commit() {
  s_.ensure_open();
  WriteStats st;
  s_.guarded([&] {
    if (cur_ >= 0 && fill_ > 0) {
      // The last, partial buffer; padded to the O_DIRECT alignment (the
      // ftruncate below cuts the padding off).
      uint64_t len = fill_;
      if (s_.direct) {
        len = round_up(fill_, s_.align);
        std::memset(s_.engine.pool().data(cur_) + fill_, 0, len - fill_);
        if (len != fill_) size_may_differ_ = true;
      }
      uint64_t fill = fill_;
      fill_ = len;  // submit_current advances buf_off_ by fill_
      submit_current(len);
      buf_off_ -= len - fill;
    }
    s_.reap_all([this] { reap_one(); });
    cur_ = -1;
    if (size_may_differ_) sys::ftruncate(s_.fd, pos_, s_.tmp);
    const double tf = now_seconds();
    s_.sync();
    s_.publish();
    st.flush_seconds = now_seconds() - tf;
  });
  st.bytes = pos_;
  st.requests = requests_;
  st.borrowed_bytes = borrowed_bytes_;
  s_.fill(st);
  return st;
}

}  // namespace fastckpt
