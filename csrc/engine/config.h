// The engine's tunables: defaults and environment overrides live here and only
// here. Python's fastckpt.knobs reads these defaults through the bindings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastckpt {

enum class BackendKind { Auto, Uring, Threads };

const char* backend_kind_name(BackendKind k);
BackendKind backend_kind_from_name(const std::string& name);  // "auto" | "uring" | "threads"

// Limits that validate() enforces.
constexpr uint64_t kMaxBufferSize = 1ull << 30;  // one staging buffer
constexpr uint64_t kMaxPoolBytes = 64ull << 30;  // buffer_size x buffer_count

struct EngineConfig {
  // Staging buffers: reserved once per Engine, backed as first used, reused by every save and load.
  // 8 x 8 MiB keeps the disk busy (see benchmarks/bench_engine.py) for 64 MiB of RAM.
  size_t buffer_size = 8u << 20;   // FASTCKPT_BUFFER_SIZE (bytes, K/M/G suffixes allowed)
  size_t buffer_count = 8;         // FASTCKPT_BUFFER_COUNT
  unsigned queue_depth = 8;        // FASTCKPT_QUEUE_DEPTH: I/Os in flight per writer/reader
  unsigned io_threads = 4;         // FASTCKPT_IO_THREADS: workers of the thread backend
  BackendKind backend = BackendKind::Auto;  // FASTCKPT_BACKEND=auto|uring|threads
  bool direct = true;              // FASTCKPT_DIRECT=0 disables O_DIRECT
  // Issue an asynchronous fdatasync after every this many bytes written, so the
  // final flush has less left to do. 0 = only the final fdatasync.
  uint64_t flush_interval = 0;     // FASTCKPT_FLUSH_INTERVAL
  bool preallocate = true;         // FASTCKPT_PREALLOCATE: fallocate when the size is known
  // A load's destinations that are read straight from the disk (O_DIRECT) are
  // faulted in ahead of the reads by a helper thread (madvise
  // MADV_POPULATE_WRITE), instead of page by page inside the submitting thread.
  bool prefault = true;            // FASTCKPT_PREFAULT

  // `base` overridden by whatever FASTCKPT_* variables are set. Throws
  // UsageError on a malformed, negative or too large value, naming the
  // variable.
  static EngineConfig from_env(EngineConfig base);
  static EngineConfig from_env() { return from_env(EngineConfig{}); }
  // Requests a reader keeps in flight at most (a backend's depth): queue_depth
  // x kReadRequestsPerDepth, at most 1024. A reader's bytes in flight stay at
  // most queue_depth x buffer_size: the extra requests are small reads (the
  // tensors of a file of small tensors, the windows between unaligned ones),
  // which alone would leave the device idle between them.
  unsigned read_requests() const {
    const uint64_t n = static_cast<uint64_t>(queue_depth) * kReadRequestsPerDepth;
    return n < 1024 ? static_cast<unsigned>(n) : 1024u;
  }
  static constexpr unsigned kReadRequestsPerDepth = 8;
  // Throws UsageError when the values cannot work together.
  void validate() const;
};

// "8M" -> 8388608; throws UsageError (naming `what`) for anything but digits
// with an optional K/M/G suffix, and for a value that does not fit 64 bits.
uint64_t parse_size(const std::string& text, const char* what);

}  // namespace fastckpt
