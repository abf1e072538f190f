// The engine: a shared pool of staging buffers and a cache of I/O backends
// (io_uring rings or thread pools), lent to the writers (writer.h,
// region_writer.h) and the range reader (reader.h).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "buffer_pool.h"
#include "config.h"

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

// Leases a backend for a writer of `target`; a refusal names the user's file.
BackendLease lease_for(Engine& engine, const std::string& target);

// Seconds of a monotonic clock (statistics).
double now_seconds();

}  // namespace fastckpt
