// RegionWriter: several processes (the ranks of a collective save) fill one
// temporary file together, each writing its own regions at absolute offsets.
//
// The creating process (the owner: `create` = true) removes the leftovers of
// crashed saves of the target, creates the temporary file with the Writer's
// name and rules (temp_file.h: O_CREAT|O_EXCL|O_NOFOLLOW, flock()ed until the
// rename) and sizes it to its final length (ftruncate: a sparse file that the
// regions fill). The others open that existing file by name (no O_CREAT, no
// O_NOFOLLOW-defeating links) and write only their regions.
//
// Each region is copied into the engine's staging buffers (optionally folding
// its bytes into a zip CRC-32 while they are hot in the cache) and written by
// the engine's backend (io_uring or the thread pool): O_DIRECT where a piece's
// offset and length are multiples of the file's direct-I/O alignment, through
// a second, buffered descriptor otherwise. A filesystem that refuses O_DIRECT
// (EINVAL at open or at the first direct write, which is done synchronously as
// a probe with the real data) gets every piece buffered; fallback() says why.
//
// finish() reaps every write and fdatasyncs the file: this process's regions
// are durable. Only the owner renames: commit() = finish() + rename over the
// target + directory fsync. abort() (or destruction before finish/commit, or
// any error) reaps everything in flight before freeing a buffer or closing a
// descriptor; the owner also removes the temporary file. Errors are IoErrors
// naming the operation, the temporary file, offset, length, errno and the
// user's target (IoError::target()). Not thread-safe: one thread per object.
#pragma once

#include <cstdint>
#include <string>

#include "engine.h"
#include "write_session.h"

namespace fastckpt {

struct RegionStats : WriteStatsBase {
  uint64_t direct_requests = 0;  // of the requests, O_DIRECT
};

class RegionWriter {
 public:
  // create = true: make the temporary file for `target`, `size` bytes long
  // (tmp is ignored; tmp_path() names it). create = false: open the existing
  // temporary file `tmp` of `target` (size is ignored).
  RegionWriter(Engine& engine, const std::string& target, const std::string& tmp, bool create, uint64_t size);
  RegionWriter(const RegionWriter&) = delete;
  RegionWriter& operator=(const RegionWriter&) = delete;

  // Writes n bytes at file offset `off` (copied before return; regions may
  // come in any order but must not overlap another process's). Aligned
  // writes go O_DIRECT, the others through the page cache, never both kinds
  // in flight at once. Processes writing one file must not mix the kinds at
  // the same time either: a buffered write near another process's direct one
  // can fail the file's writeback (see submit); the collective saves let rank
  // 0 write its unaligned pieces only after every other rank has finished. With `crc`,
  // the zip CRC-32 of the bytes is folded into *crc (zlib's convention).
  void write_at(const void* src, uint64_t n, uint64_t off, uint32_t* crc = nullptr);
  // Every write done and the file fdatasync'ed; the descriptors are closed,
  // except the owner's locked one (kept until commit/abort).
  RegionStats finish();
  // Owner only: finish(), then rename over the target and fsync the directory.
  RegionStats commit();
  void abort() noexcept { s_.abort(); }

  bool owner() const { return s_.owns_temp; }
  bool direct() const { return s_.direct; }
  const std::string& target() const { return s_.target; }
  const std::string& tmp_path() const { return s_.tmp; }
  const std::string& backend_name() const { return s_.backend; }

 private:
  void open_create(uint64_t size);
  void open_existing();
  void open_direct();
  void submit(int buf, uint64_t len, uint64_t off);
  int take_buffer();
  void reap_one();

  WriteSession s_;  // lease, queue, buffers, descriptors, commit protocol
  bool probed_ = false;
  bool inflight_direct_ = false;  // the mode of the writes in flight (see submit)
  RegionStats st_;  // bytes and requests so far
};

}  // namespace fastckpt
