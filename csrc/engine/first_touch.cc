#include "first_touch.h"

#include <chrono>
#include <cstdlib>
#include <mutex>

namespace fastckpt {

namespace {

using Clock = std::chrono::steady_clock;

struct State {
  std::mutex mu;
  bool slow_seen = false;
  uint64_t bytes = 0;
  double cpu_s = 0;
  Clock::time_point at;
};

State& state() {
  static State s;
  return s;
}

double age_locked(const State& st) { return std::chrono::duration<double>(Clock::now() - st.at).count(); }

}  // namespace

double slow_huge_bps(unsigned window) {
  const char* v = std::getenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
  if (v == nullptr || *v == 0) return kSlowHugeBps;
  double x = kSlowHugeBps;
  for (unsigned i = 0;; ++i) {
    char* end = nullptr;
    const double y = std::strtod(v, &end);
    if (end == v || y < 0 || (*end != 0 && *end != ',')) return kSlowHugeBps;  // not a list of numbers
    x = y;
    if (i == window || *end == 0) return x;
    v = end + 1;
  }
}

HugeWindow::State HugeWindow::add(uint64_t bytes, double cpu_s) {
  bytes_ += bytes;
  cpu_s_ += cpu_s > 0 ? cpu_s : 0;
  const double span = static_cast<double>(bytes_ > kHugeJudgeBytes ? bytes_ : kHugeJudgeBytes);
  if (bps_ > 0 && cpu_s_ > span / bps_) {  // the window's rate, over at least kHugeJudgeBytes, is below the threshold
    note_slow_huge_pages(bytes_, cpu_s_);
    return kSlow;
  }
  return bytes_ >= kHugeJudgeBytes ? kFast : kOpen;
}

bool prefer_huge_pages() {
  State& st = state();
  std::lock_guard<std::mutex> lk(st.mu);
  return !st.slow_seen || age_locked(st) >= kVerdictTtlS;
}

bool huge_pages_pay(uint64_t bytes) { return bytes >= kHugeJudgeMin && prefer_huge_pages(); }

HugeVerdict huge_pages_verdict() {
  State& st = state();
  std::lock_guard<std::mutex> lk(st.mu);
  HugeVerdict v;
  v.slow_seen = st.slow_seen;
  v.bytes = st.bytes;
  v.cpu_s = st.cpu_s;
  v.age_s = st.slow_seen ? age_locked(st) : 0.0;
  v.huge = !st.slow_seen || v.age_s >= kVerdictTtlS;
  return v;
}

void note_slow_huge_pages(uint64_t bytes, double cpu_s) {
  State& st = state();
  std::lock_guard<std::mutex> lk(st.mu);
  st.slow_seen = true;
  st.bytes = bytes;
  st.cpu_s = cpu_s;
  st.at = Clock::now();
}

void reset_huge_pages_verdict() {
  State& st = state();
  std::lock_guard<std::mutex> lk(st.mu);
  st.slow_seen = false;
  st.bytes = 0;
  st.cpu_s = 0;
}

}  // namespace fastckpt
