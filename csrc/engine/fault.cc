#include "fault.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "error.h"

namespace fastckpt {
namespace fault {
namespace {

struct Armed {
  Rule rule;
  uint64_t seen = 0;
};

std::atomic<bool> g_any{false};
std::atomic<uint64_t> g_fired{0};
std::mutex g_mu;
std::vector<Armed>& rules() {
  static std::vector<Armed> r;
  return r;
}

const char* const kNames[] = {"open", "write", "read", "fsync", "rename", "fallocate", "truncate", "uring_setup",
                              "uring_submit", "uring_wait", "uring_register", "read_cached"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<int>(Op::kCount), "op names");

}  // namespace

const char* op_name(Op op) { return kNames[static_cast<int>(op)]; }

Op op_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Op::kCount); ++i)
    if (name == kNames[i]) return static_cast<Op>(i);
  throw UsageError("unknown fault operation '" + name + "'");
}

void arm(const Rule& rule) {
  if (rule.nth == 0) throw UsageError("fault rule: nth is 1-based");
  std::lock_guard<std::mutex> lk(g_mu);
  rules().push_back(Armed{rule, 0});
  g_any.store(true, std::memory_order_release);
}

void clear() {
  std::lock_guard<std::mutex> lk(g_mu);
  rules().clear();
  g_fired.store(0);
  g_any.store(false, std::memory_order_release);
}

uint64_t fired() { return g_fired.load(); }

Action on(Op op, const std::string& path) {
  if (!g_any.load(std::memory_order_acquire)) return Action{};
  Action act;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (Armed& a : rules()) {
      if (a.rule.op != op) continue;
      if (!a.rule.path_contains.empty() && path.find(a.rule.path_contains) == std::string::npos) continue;
      uint64_t n = ++a.seen;
      bool hit = n >= a.rule.nth && (a.rule.times == 0 || n < a.rule.nth + a.rule.times);
      if (!hit) continue;
      if (!act.fire()) {
        act.err = a.rule.err;
        act.short_len = a.rule.short_len;
        act.delay_ms = a.rule.delay_ms;
        g_fired.fetch_add(1);
      }
    }
  }
  if (act.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(act.delay_ms));
  return act;
}

}  // namespace fault
}  // namespace fastckpt
