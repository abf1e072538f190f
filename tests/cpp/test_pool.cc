// The engine's fixed costs grow lazily: the staging pool reserves address
// space and the kernel backs a buffer's pages only when they are used; touched
// buffers are handed out again before untouched ones; an io_uring ring
// registers a buffer at its first large transfer (and a refused registration
// leaves that buffer to plain I/O); the thread backend starts workers as
// requests need them. Residency is read with mincore(2), independently of the
// pool's own bookkeeping.
#include <sys/mman.h>

#include <cctype>
#include <fstream>
#include <sstream>

#include "buffer_pool.h"
#include "first_touch.h"
#include "util.h"

using namespace fct;
using fault::Op;
using fastckpt::BackendKind;
using fastckpt::BufferPool;

namespace {

constexpr size_t MiB = 1u << 20;

// Bytes of [p, p + n) backed by memory now.
size_t resident(const char* p, size_t n) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((n + page - 1) / page);
  if (::mincore(const_cast<char*>(p), n, vec.data()) != 0)
    fail(__FILE__, __LINE__, std::string("mincore: ") + std::strerror(errno));
  size_t k = 0;
  for (unsigned char v : vec) k += v & 1;
  return k * page;
}

size_t resident(const BufferPool& pool) { return resident(pool.data(0), pool.buffer_size() * pool.count()); }

size_t resident_buffer(const BufferPool& pool, int i) { return resident(pool.data(i), pool.buffer_size()); }

EngineConfig uring_config(size_t size, size_t count, unsigned depth = 4) {
  require_uring();
  EngineConfig c;
  c.buffer_size = size;
  c.buffer_count = count;
  c.queue_depth = depth;
  c.backend = BackendKind::Uring;
  c.direct = direct_unavailable_reason().empty();
  return c;
}

}  // namespace

// ------------------------------------------------------------ the pool

TEST(new_pool_and_new_engine_touch_nothing, ONCE) {
  BufferPool pool(2 * MiB, 4);
  CHECK_EQ(resident(pool), 0u);
  CHECK_EQ(pool.touched(), 0u);
  CHECK_EQ(pool.available(), 4u);
  CHECK_EQ(pool.resident_bytes(), 0u);
  // 256 MiB of staging: reserved, not backed, until the first I/O.
  EngineConfig c;
  c.buffer_size = 32 * MiB;
  c.buffer_count = 8;
  Engine eng(c);
  CHECK_EQ(resident(eng.pool()), 0u);
  CHECK_EQ(eng.pool().touched(), 0u);
  CHECK_EQ(eng.pool().registered(), 0u);
}

TEST(buffers_start_on_a_huge_page_boundary, ONCE) {
  BufferPool pool(2 * MiB, 3);
  CHECK_EQ(reinterpret_cast<uintptr_t>(pool.data(0)) % (2 * MiB), 0u);
  // Writing into one buffer backs that buffer only (no huge page straddles two).
  std::memset(pool.data(1), 1, 4096);
  CHECK(resident_buffer(pool, 1) > 0);
  CHECK_EQ(resident_buffer(pool, 0), 0u);
  CHECK_EQ(resident_buffer(pool, 2), 0u);
}

TEST(touched_buffers_are_handed_out_before_untouched_ones, ONCE) {
  BufferPool pool(64 << 10, 4);
  int a = pool.acquire();
  CHECK_EQ(a, 0);  // untouched ones in index order
  CHECK_EQ(pool.touched(), 1u);
  CHECK(pool.is_touched(0));
  CHECK(!pool.is_touched(1));
  pool.release(a);
  // Reused, not a new one: still one buffer touched.
  for (int i = 0; i < 5; ++i) {
    int b = pool.acquire();
    CHECK_EQ(b, 0);
    pool.release(b);
  }
  CHECK_EQ(pool.touched(), 1u);
  // Two at once: the second is new.
  int x = pool.acquire(), y = pool.try_acquire();
  CHECK_EQ(x, 0);
  CHECK_EQ(y, 1);
  CHECK_EQ(pool.touched(), 2u);
  pool.release(x);
  pool.release(y);
  // Warm ones first, the one released last first; then an untouched one.
  CHECK_EQ(pool.acquire(), 1);
  CHECK_EQ(pool.acquire(), 0);
  CHECK_EQ(pool.try_acquire(), 2);
  CHECK_EQ(pool.touched(), 3u);
  CHECK_EQ(pool.try_acquire(), 3);
  CHECK_EQ(pool.try_acquire(), -1);
  CHECK_EQ(pool.touched(), 4u);
  CHECK_EQ(pool.available(), 0u);
  for (int i = 0; i < 4; ++i) pool.release(i);
  CHECK_EQ(pool.available(), 4u);
  CHECK_EQ(pool.touched(), 4u);
}

TEST(quarantined_buffers_stay_out_of_the_lazy_pool, ONCE) {
  BufferPool pool(64 << 10, 3);
  int a = pool.acquire();
  pool.quarantine(a);
  CHECK_EQ(pool.quarantined(), 1u);
  CHECK_EQ(pool.available(), 2u);
  std::vector<int> got;
  for (int i = 0; i < 4; ++i) {
    int b = pool.try_acquire();
    if (b >= 0) got.push_back(b);
  }
  CHECK_EQ(got.size(), 2u);
  for (int b : got) CHECK_NE(b, a);
  // Every buffer is held by this thread or lost: waiting would never end.
  CHECK_THROWS(UsageError, pool.acquire());
  for (int b : got) pool.release(b);
  for (int i = 0; i < 6; ++i) {
    int b = pool.acquire();
    CHECK_NE(b, a);
    pool.release(b);
  }
  CHECK_EQ(pool.available(), 2u);
}

// ------------------------------------------------------------ through the engine

TEST(a_small_save_and_load_touch_one_buffer, ALL) {
  EngineConfig c = config(8 * MiB, 8);  // the current variant
  Engine eng(c);
  TempDir dir;
  const std::string data = random_bytes(100000, 7);
  save(eng, dir.file("small.bin"), data);
  CHECK_BYTES(load(eng, dir.file("small.bin"), data.size()), data);
  CHECK_BYTES(load(eng, dir.file("small.bin"), data.size()), data);
  CHECK_POOL_FULL(eng);
  // One buffer served the write and both reads; the others were never backed.
  CHECK_EQ(eng.pool().touched(), 1u);
  CHECK(eng.pool().is_touched(0));
  const size_t r = resident(eng.pool());
  // On small pages: the few hundred KiB used, not a 2 MiB huge page.
  CHECK_MSG(r > 0 && r < 2 * MiB, std::to_string(r) + " bytes of the pool are resident");
  CHECK(!eng.pool().huge());
  CHECK_EQ(eng.pool().huge_verdict(), 0);
  for (int i = 1; i < 8; ++i) CHECK_EQ(resident_buffer(eng.pool(), i), 0u);
  CHECK_EQ(eng.pool().resident_bytes(), r);
  // Small transfers are not worth pinning a whole buffer for.
  CHECK_EQ(eng.pool().registered(), 0u);
}

TEST(large_transfers_register_their_buffers_once_per_ring, ONCE) {
  Engine eng(uring_config(1 * MiB, 4, 4));
  TempDir dir;
  // Five full buffers: the first write of an O_DIRECT file is made
  // synchronously, not on the ring, and its buffer is the next one filled.
  const std::string data = random_bytes(5 * MiB + 1000, 8);
  save(eng, dir.file("big.bin"), data);
  CHECK_BYTES(read_file(dir.file("big.bin")), data);
  const size_t touched = eng.pool().touched();
  CHECK(touched >= 2);
  // Every buffer's first request was a full 1 MiB write: each was registered.
  CHECK_EQ(eng.pool().registered(), touched);
  CHECK_EQ(eng.pool().registration_refusals(), 0u);
  // The same ring again (it was given back to the engine): nothing is
  // registered a second time.
  fault::arm(rule(Op::UringRegister, 1, ENOMEM, 0));
  save(eng, dir.file("big2.bin"), data);
  CHECK_BYTES(load(eng, dir.file("big2.bin"), data.size()), data);
  fault::clear();
  CHECK_EQ(eng.pool().registration_refusals(), 0u);
  CHECK_EQ(eng.pool().registered(), eng.pool().touched());
  CHECK_POOL_FULL(eng);
}

TEST(a_refused_buffer_registration_falls_back_to_plain_io, ONCE) {
  Engine eng(uring_config(1 * MiB, 4, 4));
  TempDir dir;
  const std::string data = random_bytes(5 * MiB + 1000, 9);  // every buffer carries a ring write
  // Occurrence 1 is the ring's buffer table, 2 the first buffer's registration.
  fault::arm(rule(Op::UringRegister, 2, ENOMEM, 1));
  const WriteStats st = save(eng, dir.file("a.bin"), data);
  CHECK_EQ(fault::fired(), 1u);
  CHECK_EQ(st.backend, std::string("io_uring"));
  CHECK_BYTES(read_file(dir.file("a.bin")), data);
  CHECK_BYTES(load(eng, dir.file("a.bin"), data.size()), data);
  CHECK_EQ(eng.pool().registration_refusals(), 1u);
  CHECK_EQ(eng.pool().registered(), eng.pool().touched() - 1);
  // The refused buffer is not asked for again, and the others stay registered.
  fault::clear();
  fault::arm(rule(Op::UringRegister, 1, ENOMEM, 0));
  save(eng, dir.file("b.bin"), data);
  CHECK_EQ(fault::fired(), 0u);
  fault::clear();
  CHECK_BYTES(read_file(dir.file("b.bin")), data);
  CHECK_EQ(eng.backend_name(), std::string("io_uring"));
  CHECK_POOL_FULL(eng);
  CHECK_NO_TEMP_FILES(dir.path());
}

TEST(a_refused_buffer_table_leaves_every_request_plain, ONCE) {
  Engine eng(uring_config(1 * MiB, 4, 4));
  TempDir dir;
  const std::string data = random_bytes(3 * MiB + 5, 10);
  fault::arm(rule(Op::UringRegister, 1, EINVAL, 1));
  save(eng, dir.file("a.bin"), data);
  CHECK_EQ(fault::fired(), 1u);
  fault::clear();
  CHECK_BYTES(read_file(dir.file("a.bin")), data);
  CHECK_BYTES(load(eng, dir.file("a.bin"), data.size()), data);
  CHECK_EQ(eng.pool().registered(), 0u);
  CHECK_EQ(eng.pool().registration_refusals(), 1u);
  CHECK_POOL_FULL(eng);
}

// ------------------------------------------------------------ the thread backend

TEST(thread_backend_starts_workers_as_requests_need_them, ONCE) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  write_file_plain(path, random_bytes(1 << 16, 11));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0);
  auto be = fastckpt::make_thread_backend(4, 8);
  CHECK_EQ(be->threads_started(), 0u);
  std::vector<char> buf(8 << 12);
  auto request = [&](int i) {
    fastckpt::IoRequest r;
    r.kind = fastckpt::IoRequest::Read;
    r.fd = fd;
    r.buf = buf.data() + (i % 8) * 4096;
    r.len = 4096;
    r.off = (i % 16) * 4096;
    r.tag = static_cast<uint64_t>(i);
    return r;
  };
  // One request at a time: one worker, however many requests.
  for (int i = 0; i < 20; ++i) {
    be->submit(request(i));
    fastckpt::IoCompletion c = be->wait();
    CHECK_EQ(c.tag, static_cast<uint64_t>(i));
    CHECK_EQ(c.res, 4096);
  }
  CHECK_EQ(be->threads_started(), 1u);
  // Eight at once: more workers, never more than asked for.
  for (int i = 0; i < 8; ++i) be->submit(request(i));
  for (int i = 0; i < 8; ++i) CHECK_EQ(be->wait().res, 4096);
  CHECK(be->threads_started() >= 1 && be->threads_started() <= 4);
  be.reset();
  ::close(fd);
}

// ------------------------------------------------------------ huge pages: the process's verdict

TEST(huge_pages_are_preferred_until_a_read_finds_them_slow, ONCE) {
  fastckpt::reset_huge_pages_verdict();
  CHECK(fastckpt::prefer_huge_pages());
  CHECK_EQ(fastckpt::huge_pages_verdict().slow_seen, false);
  fastckpt::note_slow_huge_pages(16 * MiB, 0.1);
  CHECK_EQ(fastckpt::prefer_huge_pages(), false);
  const fastckpt::HugeVerdict v = fastckpt::huge_pages_verdict();
  CHECK(v.slow_seen);
  CHECK_EQ(v.huge, false);
  CHECK_EQ(v.bytes, 16 * MiB);
  CHECK_EQ(v.cpu_s, 0.1);
  CHECK(v.age_s >= 0 && v.age_s < fastckpt::kVerdictTtlS);
  fastckpt::reset_huge_pages_verdict();
  CHECK(fastckpt::prefer_huge_pages());
}

// A judging window is slow as soon as its CPU time exceeds what kHugeJudgeBytes
// may cost at the threshold (1 GB/s here: 16.8 ms), fast once it holds
// kHugeJudgeBytes within that; a step past the window is judged by the rate.
// Only a slow window records the verdict.
TEST(a_judging_window_is_slow_once_its_budget_is_spent, ONCE) {
  using fastckpt::HugeWindow;
  const uint64_t mib = 1u << 20;
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "1e9", 1);
  fastckpt::reset_huge_pages_verdict();
  {
    HugeWindow w(0);  // fast: 16 MiB in 8 ms
    for (int i = 0; i < 7; ++i) CHECK_EQ(w.add(2 * mib, 0.001), HugeWindow::kOpen);
    CHECK_EQ(w.add(2 * mib, 0.001), HugeWindow::kFast);
    CHECK(!fastckpt::huge_pages_verdict().slow_seen);
  }
  {
    HugeWindow w(0);  // one step past the window, at 1.1 GB/s: fast although over the 16 MiB budget
    CHECK_EQ(w.add(32 * mib, 0.03), HugeWindow::kFast);
    CHECK(!fastckpt::huge_pages_verdict().slow_seen);
  }
  {
    HugeWindow w(0);  // slow after 4 MiB: 21 ms spent, more than the whole window may take
    CHECK_EQ(w.add(2 * mib, 0.001), HugeWindow::kOpen);
    CHECK_EQ(w.add(2 * mib, 0.020), HugeWindow::kSlow);
    const fastckpt::HugeVerdict v = fastckpt::huge_pages_verdict();
    CHECK(v.slow_seen && !v.huge);
    CHECK_EQ(v.bytes, 4 * mib);
    CHECK(v.cpu_s > 0.0209 && v.cpu_s < 0.0211);
  }
  fastckpt::reset_huge_pages_verdict();
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0", 1);  // no threshold: never slow
  {
    HugeWindow w(0);
    CHECK_EQ(w.add(2 * mib, 100.0), HugeWindow::kOpen);
    CHECK_EQ(w.add(14 * mib, 100.0), HugeWindow::kFast);
    CHECK(!fastckpt::huge_pages_verdict().slow_seen);
  }
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
}

TEST(the_slow_threshold_is_the_constant_unless_a_test_sets_it, ONCE) {
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
  CHECK_EQ(fastckpt::slow_huge_bps(), fastckpt::kSlowHugeBps);
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "1e18", 1);
  CHECK_EQ(fastckpt::slow_huge_bps(), 1e18);
  CHECK_EQ(fastckpt::slow_huge_bps(5), 1e18);  // one number: every window
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0,1e18", 1);  // a list: one per window, the last for the rest
  CHECK_EQ(fastckpt::slow_huge_bps(0), 0.0);
  CHECK_EQ(fastckpt::slow_huge_bps(1), 1e18);
  CHECK_EQ(fastckpt::slow_huge_bps(7), 1e18);
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "fast", 1);  // not a number: the constant
  CHECK_EQ(fastckpt::slow_huge_bps(), fastckpt::kSlowHugeBps);
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0,x", 1);
  CHECK_EQ(fastckpt::slow_huge_bps(1), fastckpt::kSlowHugeBps);
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
}

// ------------------------------------------------------------ huge pages: the pool's own

namespace {

// The VmFlags of the mapping that holds `p` (/proc/self/smaps): "hg" for
// MADV_HUGEPAGE, "nh" for MADV_NOHUGEPAGE.
std::string vm_flags(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line, flags;
  bool inside = false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  while (std::getline(f, line)) {
    const size_t dash = line.find('-'), space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space && line.compare(0, 8, "VmFlags:") != 0 &&
        std::isxdigit(static_cast<unsigned char>(line[0]))) {
      const uintptr_t lo = std::stoull(line.substr(0, dash), nullptr, 16);
      const uintptr_t hi = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
      inside = lo <= a && a < hi;
    } else if (inside && line.compare(0, 8, "VmFlags:") == 0) {
      flags = line.substr(8);
    }
  }
  return flags;
}

bool has_flag(const void* p, const char* flag) {
  std::istringstream in(vm_flags(p));
  std::string w;
  while (in >> w)
    if (w == flag) return true;
  return false;
}

// Whether this kernel has transparent huge pages (madvise then sets the flags).
bool thp_available() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  return f.good();
}

}  // namespace

// The pool starts on small pages (also under THP "always"); a session of
// kPoolHugeMin bytes or more moves it to huge pages, smaller ones never do.
// The first buffers handed out after that are faulted in by the pool, judged:
// within the budget, the verdict is fast after kHugeJudgeBytes (two 8 MiB
// buffers), and the pool stays on huge pages.
TEST(a_large_session_moves_the_pool_to_huge_pages_and_judges_them, ONCE) {
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0", 1);  // no threshold: never slow
  fastckpt::reset_huge_pages_verdict();
  BufferPool pool(8 * MiB, 4);
  if (thp_available()) CHECK(has_flag(pool.data(0), "nh"));
  pool.expect(1 * MiB);
  pool.expect(fastckpt::kPoolHugeMin - 1);
  CHECK(!pool.huge());
  pool.expect(fastckpt::kPoolHugeMin);
  CHECK(pool.huge());
  if (thp_available()) CHECK(has_flag(pool.data(0), "hg") && !has_flag(pool.data(0), "nh"));
  CHECK_EQ(resident(pool), 0u);
  const int a = pool.acquire();
  CHECK_EQ(pool.huge_verdict(), 0);  // 8 MiB judged: the window is still open
  CHECK_EQ(resident_buffer(pool, a), 8 * MiB);  // faulted in by the judge
  const int b = pool.acquire();
  CHECK_EQ(pool.huge_verdict(), 1);
  CHECK_EQ(resident_buffer(pool, b), 8 * MiB);
  const int c = pool.acquire();  // judged already: left to its first use
  CHECK_EQ(resident_buffer(pool, c), 0u);
  CHECK(pool.huge());
  CHECK(!fastckpt::huge_pages_verdict().slow_seen);
  pool.release(a);
  pool.release(b);
  pool.release(c);
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
}

// Where the first huge page faults in slower than the threshold allows, the
// judge stops at that page: every page not backed yet goes back to small
// pages for the life of the pool (also once the process's verdict has
// expired), and the loads of the process learn the verdict.
TEST(slow_huge_pages_move_the_pool_back_to_small_pages_for_good, ONCE) {
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "1e18", 1);  // every window slow
  fastckpt::reset_huge_pages_verdict();
  BufferPool pool(8 * MiB, 4);
  pool.expect(64 * MiB);
  CHECK(pool.huge());
  const int a = pool.acquire();
  CHECK_EQ(pool.huge_verdict(), 2);
  CHECK(!pool.huge());
  CHECK_EQ(resident_buffer(pool, a), fastckpt::kHugeJudgeStep);  // one step judged, no more
  const fastckpt::HugeVerdict v = fastckpt::huge_pages_verdict();
  CHECK(v.slow_seen && !v.huge);
  CHECK_EQ(v.bytes, fastckpt::kHugeJudgeStep);
  if (thp_available()) {
    CHECK(has_flag(pool.data(0) + fastckpt::kHugeJudgeStep, "nh"));
    CHECK(has_flag(pool.data(3), "nh"));
  }
  fastckpt::reset_huge_pages_verdict();  // the process may try huge pages again; this pool does not
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0", 1);
  pool.expect(1u << 30);
  CHECK(!pool.huge());
  CHECK_EQ(pool.huge_verdict(), 2);
  const int b = pool.acquire();  // not judged: left to its first use, on small pages
  CHECK_EQ(resident_buffer(pool, b), 0u);
  pool.release(a);
  pool.release(b);
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
}

// A process whose reads found huge pages slow keeps a new pool on small
// pages; a save that says its size moves the pool when it is large enough.
TEST(the_process_verdict_and_a_large_save_decide_the_pools_pages, ALL) {
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0", 1);
  TempDir dir;
  const std::string data = random_bytes(40u << 20, 9);
  {
    fastckpt::reset_huge_pages_verdict();
    fastckpt::note_slow_huge_pages(16 * MiB, 1.0);
    Engine eng(config(8 * MiB, 8));
    save(eng, dir.file("a.bin"), data, 0, static_cast<int64_t>(data.size()));
    CHECK(!eng.pool().huge());
    CHECK_EQ(eng.pool().huge_verdict(), 0);
  }
  {
    fastckpt::reset_huge_pages_verdict();
    Engine eng(config(8 * MiB, 8));
    save(eng, dir.file("b.bin"), data.substr(0, 1u << 20), 0, 1 << 20);  // under a huge page
    CHECK(!eng.pool().huge());
    save(eng, dir.file("c.bin"), data, 0, static_cast<int64_t>(data.size()));
    CHECK(eng.pool().huge());
    CHECK_EQ(eng.pool().huge_verdict(), 1);
    CHECK_BYTES(load(eng, dir.file("c.bin"), data.size()), data);
    CHECK_POOL_FULL(eng);
  }
  {
    // a save of unknown size moves it once it has written kPoolHugeMin bytes
    fastckpt::reset_huge_pages_verdict();
    Engine eng(config(8 * MiB, 8));
    save(eng, dir.file("d.bin"), data.substr(0, 1u << 20), 256u << 10);
    CHECK(!eng.pool().huge());
    save(eng, dir.file("d.bin"), data, 1u << 20);
    CHECK(eng.pool().huge());
    CHECK_BYTES(load(eng, dir.file("d.bin"), data.size()), data);
  }
  fastckpt::reset_huge_pages_verdict();
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
}

FCT_MAIN()
