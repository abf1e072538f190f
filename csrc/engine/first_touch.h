// Whether fresh memory should be on transparent huge pages here: what the
// reads of this process found when they faulted huge pages in.
//
// Memory a load returns is touched for the first time by the load itself, and
// that first touch can cost more CPU than the read. Huge pages usually make it
// cheaper (one fault per 2 MiB, and an O_DIRECT request carries 2 MiB
// segments), but not everywhere: a virtual machine whose host reclaims the
// guest's free 2 MiB blocks (virtio free-page reporting) backs each huge page
// again, 4 KiB at a time on the host, when the guest next uses it, while small
// pages come first from fragments the host never took; a kernel that must
// compact memory for a huge page stalls too. Measured on the development VM,
// a 1 GiB cold load, fresh process: on one host huge pages faulted in at
// 0.2-0.8 GB/s of CPU and small ones at 2.7; on another, huge ones at 4-7.
// No flag says which kind of machine a process runs on, and a small probe
// misleads (the first few free huge pages are often ones just given back and
// still backed), so the reads measure the faults they cause: the prefault
// helper of read_ranges times its own work, and where destinations that the
// caller put on huge pages for this read fault in slower than kSlowHugeBps,
// it advises the rest small pages and records the verdict here, for the
// allocations of the loads that follow.
#pragma once

#include <cstdint>

namespace fastckpt {

// Huge pages faulting in slower than this (bytes per CPU-second of the
// faulting thread) lose to small pages, which fault in at 2.5-3.5 GB/s on the
// machines measured (first touch, fresh memory).
constexpr double kSlowHugeBps = 1.5e9;
// Reads judge huge pages over windows of at least this many bytes.
constexpr uint64_t kHugeJudgeBytes = 16u << 20;
// The threshold for the `window`-th window a read judges (0: the first):
// kSlowHugeBps, or the test-only FASTCKPT_TEST_SLOW_HUGE_BPS, bytes per
// CPU-second, one number for every window (1e18 makes every window slow, 0
// none) or a comma-separated list, one per window, the last for the rest.
double slow_huge_bps(unsigned window = 0);
// A read judges its first window before reading (judge_first) from this
// many destination bytes on; loads under it go on small pages under the
// default (huge_pages_pay): nothing would judge them, and here one huge page
// can take 30-90 ms to fault in (measured, fresh process), more than a
// 64 MiB torch.load takes, against a few ms that huge pages could save them.
constexpr uint64_t kHugeJudgeMin = 32u << 20;
// judge_first faults its window in steps of one huge page.
constexpr uint64_t kHugeJudgeStep = 2u << 20;

// One judging window of huge-page faults (the `nth` a read judges), fed step
// by step with the bytes faulted in and the faulting thread's CPU time for
// them. Slow as soon as that time exceeds what the whole window may cost at
// the threshold: its rate can then only end below it, so the verdict is the
// full window's, without faulting the rest of it in at the slow rate (16 MiB
// at the 0.1 GB/s measured here is 160 ms; the budget at 1.5 GB/s is 11 ms).
// Fast once it holds kHugeJudgeBytes within the budget. A slow window records
// the verdict (note_slow_huge_pages).
class HugeWindow {
 public:
  enum State { kOpen, kFast, kSlow };
  explicit HugeWindow(unsigned nth) : bps_(slow_huge_bps(nth)) {}
  State add(uint64_t bytes, double cpu_s);
  uint64_t bytes() const { return bytes_; }

 private:
  double bps_;
  uint64_t bytes_ = 0;
  double cpu_s_ = 0;
};

// A verdict against huge pages stands this long; then loads try them again.
constexpr double kVerdictTtlS = 60.0;

struct HugeVerdict {
  bool huge = true;       // what prefer_huge_pages() answers now
  bool slow_seen = false;  // whether a read found huge pages slow (ever, in this process)
  uint64_t bytes = 0;      // the window that was judged slow
  double cpu_s = 0;        // the faulting thread's CPU time over it
  double age_s = 0;        // since then
};

// Huge pages unless a read of this process found them slow less than
// kVerdictTtlS seconds ago. Thread-safe.
bool prefer_huge_pages();
// Whether a load of `bytes` should allocate its memory on huge pages:
// prefer_huge_pages(), and at least kHugeJudgeMin bytes.
bool huge_pages_pay(uint64_t bytes);
HugeVerdict huge_pages_verdict();
// Records a window of huge-page faults found slow (the prefault helper).
void note_slow_huge_pages(uint64_t bytes, double cpu_s);
// Forgets the verdict (tests).
void reset_huge_pages_verdict();

}  // namespace fastckpt
