// The parallel range reader: fills caller memory from byte ranges of one
// file, from the page cache first, then with O_DIRECT reads straight into the
// destinations or through the engine's staging buffers, with per-range CRC-32s
// computed as the bytes land.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"

namespace fastckpt {

struct ReadRange {
  void* dst;
  uint64_t len;
  uint64_t off;
  // When set, receives the zip CRC-32 (crc32() from 0) of the range's bytes
  // once read_ranges returns. The engine computes it while the other reads
  // are in flight: each direct read's piece when its request is reaped, each
  // staged piece right after it is copied out of the staging buffer (still
  // in the cache), combined in file order (crc32_combine). Undefined if
  // read_ranges throws.
  uint32_t* crc = nullptr;
};

// read_ranges reads through a gap of up to this many bytes between two ranges
// it reads from the disk (one request instead of two; the gap goes to staging).
constexpr uint64_t kCoalesceGap = 64u << 10;

struct ReadStats {
  uint64_t bytes = 0;        // bytes delivered to the caller
  uint64_t bytes_read = 0;   // bytes read from the file (incl. alignment/coalescing)
  uint64_t requests = 0;
  uint64_t direct_requests = 0;  // pieces read straight into caller memory (no copy)
  uint64_t vectored_requests = 0;  // of requests, those reading several pieces (preadv)
  uint64_t peak_requests = 0;      // requests in flight at once, at most
  uint64_t staged_bytes = 0;       // of bytes_read, read into staging buffers and copied out
  uint64_t cached_bytes = 0;     // of bytes_read, served from the page cache (no request, no staging)
  uint64_t prefaulted_bytes = 0;  // destination bytes the prefault helper faulted in (EngineConfig::prefault)
  // With fresh_huge: destination bytes the helper advised small pages after
  // it found huge pages faulting in slowly (first_touch.h).
  uint64_t small_paged_bytes = 0;
  double seconds = 0;
  bool direct = false;
  std::string backend;
};

// Fills caller memory from byte ranges of one file. First from the page
// cache: in file order, each range's cached prefix is copied by the calling
// thread (sys::pread_cached, RWF_NOWAIT: never waits for the disk) until the
// first range that is not wholly cached; when everything was cached, no
// backend is leased and no staging buffer is touched. The rest with parallel
// reads: O_DIRECT straight into the destination where it is aligned, otherwise
// through staging buffers (coalescing nearby ranges). Throws TruncatedError if
// a range lies beyond the end of the file, IoError on an I/O failure.
// With `same_file_fd` >= 0 (a descriptor the caller holds open on `path`), the
// file read is the one that descriptor refers to, even if `path` has been
// renamed over since (it is reopened through /proc/self/fd); `path` still names
// it in errors.
// `fresh_huge`: the destinations are memory the caller allocated for this
// read, advised huge pages, untouched and mapped by nothing else. The
// prefault helper then judges the huge pages it faults in, and where they come
// slower than small pages would (first_touch.h) it advises the destinations
// it has not reached small pages and records that verdict for the process.
ReadStats read_ranges(Engine& engine, const std::string& path, const std::vector<ReadRange>& ranges,
                      int same_file_fd = -1, bool fresh_huge = false);

}  // namespace fastckpt
