// The engine: a shared pool of staging buffers and I/O backends, a durable
// Writer (temporary file, O_DIRECT + async writes overlapped with the copy,
// fdatasync, rename, directory fsync) and a parallel range reader.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "buffer_pool.h"
#include "config.h"
#include "io_queue.h"
#include "sys.h"

namespace fastckpt {

class Engine;

// A backend borrowed from an Engine; returned to it on destruction unless
// discarded (after a backend failure).
class BackendLease {
 public:
  BackendLease(Engine* eng, std::unique_ptr<Backend> be) : eng_(eng), be_(std::move(be)) {}
  BackendLease(BackendLease&&) = default;
  ~BackendLease();
  Backend& get() { return *be_; }
  void discard() { be_.reset(); }
  // Gives the backend back to the engine now (after the last use).
  void give_back();

 private:
  Engine* eng_;
  std::unique_ptr<Backend> be_;
};

// Everything an engine owns grows as the first I/O needs it, and stays for
// the next: making an Engine validates the configuration and reserves the
// pool's address space (no page touched, no ring, no thread); a lease makes a
// backend only when no idle one is cached (an io_uring ring with an empty
// buffer table, or a thread pool that starts workers as requests come); a
// buffer is touched when the pool first hands it out and registered with a
// ring when a request on that ring first uses it (BufferPool, backend.h).
class Engine {
 public:
  explicit Engine(const EngineConfig& cfg);
  // In a forked child, leaves the parent's backends and buffer pool alone
  // (leaked): their threads, locks and condition variables belong to the parent.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  const EngineConfig& config() const { return cfg_; }
  BufferPool& pool() { return *pool_; }
  BackendLease lease();
  // The backend in use ("io_uring" or "threads"), resolving it if needed.
  std::string backend_name();
  // Why io_uring is not used (empty when it is, or was never tried).
  std::string uring_refusal();
  // How many backends (rings, thread pools) this engine has made so far.
  uint64_t backends_created();
  // Throws UsageError in a process other than the one that made this engine
  // (after fork(): the parent's I/O threads do not exist in the child, and an
  // io_uring ring must not be shared with it).
  void check_process() const;

 private:
  friend class BackendLease;
  std::unique_ptr<Backend> create_backend();
  void give_back(std::unique_ptr<Backend> be);

  EngineConfig cfg_;
  std::unique_ptr<BufferPool> pool_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Backend>> idle_;
  bool uring_refused_ = false;
  std::string refusal_;
  std::string resolved_;
  uint64_t created_ = 0;
  int pid_;  // the process that made this engine
};

struct WriteStats {
  uint64_t bytes = 0;          // true file size
  uint64_t requests = 0;       // write requests issued (excluding requeues)
  uint64_t requeued = 0;       // short transfers and EINTR/EAGAIN resubmitted
  double seconds = 0;          // open to durable commit
  double flush_seconds = 0;    // final fdatasync + rename + directory fsync
  bool direct = false;         // O_DIRECT was used
  std::string backend;
  uint32_t alignment = 0;      // file offset alignment used for O_DIRECT
  std::string fallback;        // why O_DIRECT was not used, if it was not
  // Temporary files of crashed saves of the same target, removed before this
  // save began (names; see temp_file.h for when a file counts as one).
  std::vector<std::string> leftovers_removed;
};

// Leases a backend for a writer of `target`; a refusal names the user's file.
BackendLease lease_for(Engine& engine, const std::string& target);

// The staging buffers one writer or reader holds: at most `limit` taken from
// the pool, those not in flight kept for reuse (put_back).
class HeldBuffers {
 public:
  // A buffer not in flight, or a new one from the pool while fewer than
  // `limit` are held (blocking for it only when none of ours is in flight on
  // `q`, which could give one back); -1 when the caller must reap first.
  int try_take(BufferPool& pool, const IoQueue& q, size_t limit) {
    if (!free_.empty()) {
      int b = free_.back();
      free_.pop_back();
      return b;
    }
    if (held_.size() < limit) {
      int b = held_.empty() || q.inflight() == 0 ? pool.acquire() : pool.try_acquire();
      if (b >= 0) held_.push_back(b);
      return b;
    }
    return -1;
  }
  // try_take, reaping (which put_back()s what completed) until one is free.
  template <class Reap>
  int take(BufferPool& pool, const IoQueue& q, size_t limit, Reap reap) {
    for (;;) {
      int b = try_take(pool, q, limit);
      if (b >= 0) return b;
      reap();  // some of our buffers are in flight: wait for one
    }
  }
  void put_back(int b) { free_.push_back(b); }
  // Every held buffer back to the pool, except one the kernel may still be
  // reading (its request was never reaped: `unreaped`), which is quarantined.
  void release(BufferPool& pool, const std::vector<int>& unreaped) noexcept;

 private:
  std::vector<int> held_;  // taken from the pool
  std::vector<int> free_;  // of those, the ones not in flight
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
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Appends n bytes at the current position (copied before return). With
  // `crc`, also folds the bytes into that zip CRC-32 while they are hot in
  // the cache after the copy.
  void append(const void* src, uint64_t n, uint32_t* crc = nullptr);
  // Writes n bytes at file offset `off` >= position(); the gap is zero-filled.
  void write_at(const void* src, uint64_t n, uint64_t off);
  void append_zeros(uint64_t n);
  uint64_t position() const { return pos_; }

  WriteStats commit();
  void abort() noexcept;

  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_; }
  const std::string& backend_name() const { return backend_; }
  // Leftovers of crashed saves of this target removed when this Writer began.
  const std::vector<std::string>& leftovers_removed() const { return leftovers_; }

 private:
  void open_temp();
  void put(const char* src, uint64_t n, uint32_t* crc);
  int take_buffer();
  void submit_current(uint64_t len);
  void reap_one();
  void release_buffers(const std::vector<int>& unreaped = {}) noexcept;
  void ensure_open() const;

  Engine& eng_;
  const EngineConfig& cfg_;
  std::string path_, dir_, tmp_, backend_;
  BackendLease lease_;
  std::unique_ptr<IoQueue> q_;
  int fd_ = -1;
  enum class State { Open, Committed, Aborted } state_ = State::Open;
  bool direct_ = false;
  uint32_t align_ = 1;
  std::string fallback_;
  std::vector<std::string> leftovers_;
  HeldBuffers bufs_;            // staging buffers taken from the pool
  int cur_ = -1;                // buffer being filled
  uint64_t fill_ = 0;           // bytes in cur_
  uint64_t buf_off_ = 0;        // file offset of cur_'s first byte
  uint64_t pos_ = 0;            // logical end of file
  uint64_t done_bytes_ = 0;     // bytes whose write completed
  uint64_t next_flush_ = 0;     // flush_interval bookkeeping
  bool flush_inflight_ = false;
  bool size_may_differ_ = false;  // padded tail or preallocation: ftruncate at commit
  uint64_t requests_ = 0;
  double t0_ = 0;
};

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

struct ReadStats {
  uint64_t bytes = 0;        // bytes delivered to the caller
  uint64_t bytes_read = 0;   // bytes read from the file (incl. alignment/coalescing)
  uint64_t requests = 0;
  uint64_t direct_requests = 0;  // read straight into caller memory (no copy)
  uint64_t cached_bytes = 0;     // of bytes_read, served from the page cache (no request, no staging)
  uint64_t prefaulted_bytes = 0;  // destination bytes the prefault helper faulted in (EngineConfig::prefault)
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
ReadStats read_ranges(Engine& engine, const std::string& path, const std::vector<ReadRange>& ranges,
                      int same_file_fd = -1);

// Zip CRC-32 (zlib's polynomial) of n bytes, continuing from `crc` (zlib's
// convention: crc32(crc32(0, a), b) is the CRC of a followed by b). ISA-L's
// crc32_gzip_refl where the build has it (FASTCKPT_HAVE_ISAL), else zlib's
// crc32_z; both give the same values.
uint32_t crc32(uint32_t crc, const void* data, uint64_t n);
// The CRC-32 of a followed by b, from crc1 = crc32(0, a), crc2 = crc32(0, b)
// and len2 = the length of b (zlib's crc32_combine).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
// The implementation crc32() uses in this build: "isa-l" or "zlib".
const char* crc32_impl();

double now_seconds();

}  // namespace fastckpt
