#include "config.h"

#include <cstdint>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "error.h"

namespace fastckpt {

const char* backend_kind_name(BackendKind k) {
  switch (k) {
    case BackendKind::Auto: return "auto";
    case BackendKind::Uring: return "uring";
    case BackendKind::Threads: return "threads";
  }
  return "?";
}

BackendKind backend_kind_from_name(const std::string& name) {
  if (name == "auto" || name.empty()) return BackendKind::Auto;
  if (name == "uring" || name == "io_uring") return BackendKind::Uring;
  if (name == "threads") return BackendKind::Threads;
  throw UsageError("unknown backend '" + name + "' (expected auto, uring or threads)");
}

uint64_t parse_size(const std::string& text, const char* what) {
  if (text.empty()) throw UsageError(std::string(what) + ": empty value");
  // Digits only (std::stoull would take "-1" as 2^64-1 and skip blanks).
  size_t pos = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') ++pos;
  if (pos == 0) throw UsageError(std::string(what) + ": not a size: '" + text + "' (expected digits and K, M or G)");
  unsigned long long v = 0;
  try {
    v = std::stoull(text.substr(0, pos), nullptr, 10);
  } catch (const std::exception&) {
    throw UsageError(std::string(what) + ": '" + text + "' is too large");
  }
  std::string suffix = text.substr(pos);
  uint64_t mult = 1;
  if (suffix.empty() || suffix == "B") mult = 1;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k") mult = 1ull << 10;
  else if (suffix == "M" || suffix == "MiB") mult = 1ull << 20;
  else if (suffix == "G" || suffix == "GiB") mult = 1ull << 30;
  else throw UsageError(std::string(what) + ": bad size suffix in '" + text + "'");
  if (v > UINT64_MAX / mult) throw UsageError(std::string(what) + ": '" + text + "' is too large");
  return static_cast<uint64_t>(v) * mult;
}

// A size that must fit an `unsigned` knob; larger values are refused here
// rather than wrapped around by the conversion.
static unsigned parse_count(const std::string& text, const char* what) {
  uint64_t v = parse_size(text, what);
  if (v > 0xffffffffull) throw UsageError(std::string(what) + ": '" + text + "' is too large");
  return static_cast<unsigned>(v);
}

static bool parse_bool(const std::string& text, const char* what) {
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off") return false;
  throw UsageError(std::string(what) + ": expected 0 or 1, got '" + text + "'");
}

EngineConfig EngineConfig::from_env(EngineConfig c) {
  auto get = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return (v && *v) ? v : nullptr;
  };
  if (const char* v = get("FASTCKPT_BUFFER_SIZE")) c.buffer_size = parse_size(v, "FASTCKPT_BUFFER_SIZE");
  if (const char* v = get("FASTCKPT_BUFFER_COUNT")) c.buffer_count = parse_size(v, "FASTCKPT_BUFFER_COUNT");
  if (const char* v = get("FASTCKPT_QUEUE_DEPTH")) c.queue_depth = parse_count(v, "FASTCKPT_QUEUE_DEPTH");
  if (const char* v = get("FASTCKPT_IO_THREADS")) c.io_threads = parse_count(v, "FASTCKPT_IO_THREADS");
  if (const char* v = get("FASTCKPT_BACKEND")) c.backend = backend_kind_from_name(v);
  if (const char* v = get("FASTCKPT_DIRECT")) c.direct = parse_bool(v, "FASTCKPT_DIRECT");
  if (const char* v = get("FASTCKPT_FLUSH_INTERVAL")) c.flush_interval = parse_size(v, "FASTCKPT_FLUSH_INTERVAL");
  if (const char* v = get("FASTCKPT_PREALLOCATE")) c.preallocate = parse_bool(v, "FASTCKPT_PREALLOCATE");
  if (const char* v = get("FASTCKPT_PREFAULT")) c.prefault = parse_bool(v, "FASTCKPT_PREFAULT");
  c.validate();
  return c;
}

void EngineConfig::validate() const {
  if (buffer_size < 4096 || buffer_size % 4096 != 0)
    throw UsageError("buffer_size (FASTCKPT_BUFFER_SIZE) must be a positive multiple of 4096, got " +
                     std::to_string(buffer_size));
  if (buffer_size > kMaxBufferSize)
    throw UsageError("buffer_size (FASTCKPT_BUFFER_SIZE) must be at most 1 GiB, got " + std::to_string(buffer_size));
  if (buffer_count < 1 || buffer_count > 4096)
    throw UsageError("buffer_count (FASTCKPT_BUFFER_COUNT) must be in 1..4096, got " + std::to_string(buffer_count));
  // Both are bounded above, so the product cannot overflow; it is the pool's size.
  const uint64_t total = static_cast<uint64_t>(buffer_size) * static_cast<uint64_t>(buffer_count);
  if (total > kMaxPoolBytes)
    throw UsageError("buffer_size x buffer_count (FASTCKPT_BUFFER_SIZE x FASTCKPT_BUFFER_COUNT) = " +
                     std::to_string(total) + " bytes of staging buffers is above the limit of " +
                     std::to_string(kMaxPoolBytes) + " (64 GiB)");
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && total > static_cast<uint64_t>(pages) * static_cast<uint64_t>(page))
    throw UsageError("buffer_size x buffer_count (FASTCKPT_BUFFER_SIZE x FASTCKPT_BUFFER_COUNT) = " +
                     std::to_string(total) + " bytes of staging buffers is more than this machine's memory (" +
                     std::to_string(static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)) +
                     " bytes); a large save touches every buffer");
  if (queue_depth < 1 || queue_depth > 1024)
    throw UsageError("queue_depth (FASTCKPT_QUEUE_DEPTH) must be in 1..1024, got " + std::to_string(queue_depth));
  if (io_threads < 1 || io_threads > 256)
    throw UsageError("io_threads (FASTCKPT_IO_THREADS) must be in 1..256, got " + std::to_string(io_threads));
}

}  // namespace fastckpt
