#include "fault.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "error.h"
#include "sys.h"
#include "temp_file.h"

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
                              "uring_submit", "uring_wait", "uring_register", "read_cached",
                              "cache_query"};
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

namespace {

// A temporary stands for its target: every component of `path` that is a
// temporary name (a file's, or a directory's with its ".dcp"/".del"/".old"
// suffix) is matched as the target's name too ("/d/.fastckpt-tmp.<key>..." as
// "/d/<target>"): the names no longer spell their targets out. Empty when no
// component is one.
std::string as_target(const std::string& path) {
  if (path.find(".fastckpt-tmp.") == std::string::npos) return std::string();
  std::string out;
  bool mapped = false;
  size_t i = 0;
  for (;;) {
    const size_t j = path.find('/', i);
    std::string part = path.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (part.find(".fastckpt-tmp.") != std::string::npos) {
      TempNameInfo info;
      std::string base = part;
      for (const char* kind : {".dcp", ".del", ".old"}) {
        const size_t k = std::strlen(kind);
        if (base.size() > k && base.compare(base.size() - k, k, kind) == 0) base.resize(base.size() - k);
      }
      if ((parse_temp_entry(part, &info) || parse_temp_entry(base, &info)) && !info.target.empty()) {
        part = info.target;
        mapped = true;
      }
    }
    out += part;
    if (j == std::string::npos) break;
    out.push_back('/');
    i = j + 1;
  }
  return mapped ? out : std::string();
}

bool matches(const std::string& want, const std::string& path, const std::string& target) {
  return want.empty() || path.find(want) != std::string::npos ||
         (!target.empty() && target.find(want) != std::string::npos);
}

}  // namespace

Action on(Op op, const std::string& path) {
  if (!g_any.load(std::memory_order_acquire)) return Action{};
  const std::string target = as_target(path);
  Action act;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (Armed& a : rules()) {
      if (a.rule.op != op) continue;
      if (!matches(a.rule.path_contains, path, target)) continue;
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
