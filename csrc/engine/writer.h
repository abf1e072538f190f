// The durable Writer: one file written through the engine's staging buffers
// (O_DIRECT + async writes overlapped with the copy), then fdatasync, rename,
// directory fsync (write_session.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"
#include "write_session.h"

namespace fastckpt {

struct WriteStats : WriteStatsBase {
  double flush_seconds = 0;    // final fdatasync + rename + directory fsync
  uint64_t borrowed_bytes = 0;  // written O_DIRECT straight from the callers' memory (append_borrowed)
};

// Writes one file durably and atomically. Data goes to a temporary file in the
// target's directory ("." + name + ".fastckpt-tmp.<pid>.<host>.<start>.<n>.<r>",
// created with O_EXCL|O_NOFOLLOW and flock()ed; see temp_file.h); commit()
// makes it durable and renames it over the final name; abort() (or destruction
// without commit, or any error) removes it. Before creating it, the Writer
// removes what crashed saves of the same target on this host left behind.
// An IoError from a Writer names the user's target as well as the file the
// call failed on (IoError::target()). Not thread-safe: one thread per Writer.
class Writer {
 public:
  // expected_size >= 0 preallocates the file (when the config allows).
  Writer(Engine& engine, const std::string& path, int64_t expected_size = -1);
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Appends n bytes at the current position (copied before return). With
  // `crc`, also folds the bytes into that zip CRC-32 while they are hot in
  // the cache after the copy.
  void append(const void* src, uint64_t n, uint32_t* crc = nullptr);
  // Appends like append(), without the copy where it can: when the file is
  // written O_DIRECT and src sits at the file position's phase (src -
  // position() a multiple of the direct-I/O memory and offset alignments),
  // the aligned body of the range is written straight from src, and only its
  // head and tail (under an alignment block each) go through the staging
  // buffers. Elsewhere it is append(). The caller lends the memory: it must
  // stay valid and unchanged until commit() or abort() has returned (the
  // kernel reads it until then; a failed write reaps every request before it
  // throws, and a write that could never be reaped only reads the memory,
  // into the temporary file that abort() removes). With `crc`, the CRC is
  // folded from src.
  void append_borrowed(const void* src, uint64_t n, uint32_t* crc = nullptr);
  // Waits until every write request in flight has completed (the borrowed
  // ones too): from its return no request of this writer reads memory lent
  // before it, and that memory may change (its bytes are in the file; the
  // partly filled staging buffer holds copies). The file stays open for more
  // appends. An error aborts the write, as any failed write does.
  void drain();
  // Writes n bytes at file offset `off` >= position(); the gap is zero-filled.
  void write_at(const void* src, uint64_t n, uint64_t off);
  void append_zeros(uint64_t n);
  uint64_t position() const { return pos_; }

  WriteStats commit();
  void abort() noexcept { s_.abort(); }

  bool direct() const { return s_.direct; }
  const std::string& path() const { return s_.target; }
  const std::string& tmp_path() const { return s_.tmp; }
  const std::string& backend_name() const { return s_.backend; }
  // Leftovers of crashed saves of this target removed when this Writer began.
  const std::vector<std::string>& leftovers_removed() const { return s_.leftovers; }

 private:
  void open_temp(int64_t expected_size);
  void put(const char* src, uint64_t n, uint32_t* crc);
  int take_buffer();
  // The first write of a session that opened its file O_DIRECT, made
  // synchronously (false for every later one): some filesystems accept
  // O_DIRECT at open and refuse it at the first write (EINVAL). That write is
  // then made again buffered, as every later one is, and the session records
  // the fallback; any other error is the save's.
  bool write_first(const char* buf, uint64_t len, uint64_t off);
  void submit_current(uint64_t len);
  void reap_one();
  void submit_borrowed(const char* src, uint64_t len);

  WriteSession s_;              // lease, queue, buffers, temporary file, commit protocol
  int cur_ = -1;                // buffer being filled
  uint64_t fill_ = 0;           // bytes in cur_
  uint64_t buf_off_ = 0;        // file offset of cur_'s first byte
  uint64_t pos_ = 0;            // logical end of file
  uint64_t expected_ = 0;       // the file's size when the caller said it (else 0)
  uint64_t done_bytes_ = 0;     // bytes whose write completed
  uint64_t next_flush_ = 0;     // flush_interval bookkeeping
  bool flush_inflight_ = false;
  bool size_may_differ_ = false;  // padded tail or preallocation: ftruncate at commit
  bool probe_ = false;            // the next write is the first of an O_DIRECT file (write_first)
  uint64_t requests_ = 0;
  uint64_t borrowed_bytes_ = 0;
  uint32_t mem_align_ = 1;      // direct-I/O memory alignment (when direct)
};

}  // namespace fastckpt
