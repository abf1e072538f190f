#include "engine.h"

#include <unistd.h>

#include <chrono>

#include "error.h"

namespace fastckpt {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

BackendLease::~BackendLease() { give_back(); }

void BackendLease::give_back() {
  if (be_ && eng_) eng_->give_back(std::move(be_));
}

Engine::Engine(const EngineConfig& cfg)
    : cfg_(cfg),
      pool_(new BufferPool((cfg.validate(), cfg.buffer_size), cfg.buffer_count)),
      pid_(static_cast<int>(::getpid())) {}

Engine::~Engine() {
  if (static_cast<int>(::getpid()) == pid_) return;
  for (auto& be : idle_) (void)be.release();
  (void)pool_.release();
}

void Engine::check_process() const {
  const int now = static_cast<int>(::getpid());
  if (now != pid_)
    throw UsageError("fastckpt engine: made in process " + std::to_string(pid_) + ", used in process " +
                     std::to_string(now) +
                     " after fork(): its I/O threads and io_uring rings belong to the parent. Make a new engine in "
                     "the child (fastckpt.get_engine() does so after a fork)");
}

std::unique_ptr<Backend> Engine::create_backend() {
  bool try_uring;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++created_;
    try_uring = cfg_.backend == BackendKind::Uring || (cfg_.backend == BackendKind::Auto && !uring_refused_);
  }
  if (try_uring) {
    try {
      return make_uring_backend(cfg_.read_requests(), pool_.get());  // writers keep queue_depth
    } catch (const IoError& e) {
      if (cfg_.backend == BackendKind::Uring) throw;
      std::lock_guard<std::mutex> lk(mu_);
      uring_refused_ = true;
      refusal_ = e.what();
    }
  }
  return make_thread_backend(cfg_.io_threads, cfg_.read_requests());
}

BackendLease Engine::lease() {
  check_process();  // before taking mu_, which a parent's thread may have held at fork()
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!idle_.empty()) {
      std::unique_ptr<Backend> be = std::move(idle_.back());
      idle_.pop_back();
      return BackendLease(this, std::move(be));
    }
  }
  std::unique_ptr<Backend> be = create_backend();
  {
    std::lock_guard<std::mutex> lk(mu_);
    resolved_ = be->name();
  }
  return BackendLease(this, std::move(be));
}

void Engine::give_back(std::unique_ptr<Backend> be) {
  std::lock_guard<std::mutex> lk(mu_);
  idle_.push_back(std::move(be));
}

std::string Engine::backend_name() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!resolved_.empty()) return resolved_;
  }
  BackendLease l = lease();
  return l.get().name();
}

uint64_t Engine::backends_created() {
  std::lock_guard<std::mutex> lk(mu_);
  return created_;
}

std::string Engine::uring_refusal() {
  std::lock_guard<std::mutex> lk(mu_);
  return refusal_;
}

BackendLease lease_for(Engine& engine, const std::string& path) {
  try {
    return engine.lease();
  } catch (const IoError& e) {
    throw e.saving(path);
  }
}

}  // namespace fastckpt
