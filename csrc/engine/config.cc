#include "config.h"

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
  size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &pos, 10);
  } catch (const std::exception&) {
    throw UsageError(std::string(what) + ": not a size: '" + text + "'");
  }
  std::string suffix = text.substr(pos);
  uint64_t mult = 1;
  if (suffix.empty() || suffix == "B") mult = 1;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k") mult = 1ull << 10;
  else if (suffix == "M" || suffix == "MiB") mult = 1ull << 20;
  else if (suffix == "G" || suffix == "GiB") mult = 1ull << 30;
  else throw UsageError(std::string(what) + ": bad size suffix in '" + text + "'");
  return static_cast<uint64_t>(v) * mult;
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
  if (const char* v = get("FASTCKPT_QUEUE_DEPTH")) c.queue_depth = static_cast<unsigned>(parse_size(v, "FASTCKPT_QUEUE_DEPTH"));
  if (const char* v = get("FASTCKPT_IO_THREADS")) c.io_threads = static_cast<unsigned>(parse_size(v, "FASTCKPT_IO_THREADS"));
  if (const char* v = get("FASTCKPT_BACKEND")) c.backend = backend_kind_from_name(v);
  if (const char* v = get("FASTCKPT_DIRECT")) c.direct = parse_bool(v, "FASTCKPT_DIRECT");
  if (const char* v = get("FASTCKPT_FLUSH_INTERVAL")) c.flush_interval = parse_size(v, "FASTCKPT_FLUSH_INTERVAL");
  if (const char* v = get("FASTCKPT_PREALLOCATE")) c.preallocate = parse_bool(v, "FASTCKPT_PREALLOCATE");
  c.validate();
  return c;
}

void EngineConfig::validate() const {
  if (buffer_size < 4096 || buffer_size % 4096 != 0)
    throw UsageError("buffer_size must be a positive multiple of 4096, got " + std::to_string(buffer_size));
  if (buffer_size > (1ull << 30)) throw UsageError("buffer_size above 1 GiB");
  if (buffer_count < 1 || buffer_count > 4096) throw UsageError("buffer_count must be in 1..4096");
  if (queue_depth < 1 || queue_depth > 1024) throw UsageError("queue_depth must be in 1..1024");
  if (io_threads < 1 || io_threads > 256) throw UsageError("io_threads must be in 1..256");
}

}  // namespace fastckpt
