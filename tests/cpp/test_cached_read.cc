// read_ranges serves cached bytes first (sys::pread_cached: preadv2 with
// RWF_NOWAIT on a buffered descriptor), the rest from the disk: same bytes and
// the same per-range CRC-32 either way or mixed; a wholly cached read makes no
// backend and touches no staging buffer; a kernel refusing RWF_NOWAIT (or a
// miss) falls back to the normal path.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>

#include "first_touch.h"
#include "util.h"

using namespace fct;
using fault::Op;

namespace {

uint32_t zcrc(const std::string& s, size_t off, size_t n) {
  return static_cast<uint32_t>(::crc32_z(0, reinterpret_cast<const Bytef*>(s.data() + off), n));
}

struct Want {
  uint64_t off, len;
};

// Reads `want` (in the given order) with a CRC for each; checks bytes and CRCs
// against `data`, returns the stats.
ReadStats read_and_check(Engine& eng, const std::string& path, const std::string& data, const std::vector<Want>& want,
                         const char* what) {
  std::vector<std::string> out;
  std::vector<uint32_t> crcs(want.size(), 0xdeadbeef);
  out.reserve(want.size());
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < want.size(); ++i) {
    out.emplace_back(want[i].len, '\x55');
    rs.push_back(ReadRange{&out.back()[0], want[i].len, want[i].off, &crcs[i]});
  }
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  for (size_t i = 0; i < want.size(); ++i) {
    CHECK_BYTES(out[i], data.substr(want[i].off, want[i].len));
    CHECK_MSG(crcs[i] == zcrc(data, want[i].off, want[i].len), std::string(what) + ": CRC of range " +
                                                                    std::to_string(i));
  }
  CHECK_POOL_FULL(eng);
  return st;
}

const std::vector<Want> kRanges = {{0, 100000}, {123457, 300001}, {4096, 8192}, {700001, 99}, {800000, 248576 + 77}};
const size_t kSize = (1u << 20) + 77;

}  // namespace

TEST(cached_file_reads_from_the_page_cache_with_the_same_bytes_and_crcs, ALL) {
  TempDir dir;
  const std::string path = dir.file("c.bin");
  const std::string data = random_bytes(kSize, 31);
  write_file_plain(path, data);  // buffered: in the page cache
  Engine eng(config());
  ReadStats st;
  {
    CachePin pin(path);
    st = read_and_check(eng, path, data, kRanges, "cached");
  }
  uint64_t total = 0;
  for (const Want& w : kRanges) total += w.len;
  CHECK_EQ(st.cached_bytes, total);
  CHECK_EQ(st.bytes_read, total);
  CHECK_EQ(st.requests, 0u);
  CHECK_EQ(eng.backends_created(), 0u);  // no ring, no thread pool
  CHECK_EQ(eng.pool().touched(), 0u);    // no staging buffer
  // The same ranges from the disk: same bytes, same CRCs.
  evict(path);
  st = read_and_check(eng, path, data, kRanges, "disk");
  CHECK_EQ(st.cached_bytes, 0u);  // the first range's first page missed: all from the disk
  CHECK(st.requests > 0);
  CHECK_EQ(eng.backends_created(), 1u);
  if (variant().direct) CHECK(st.direct);
}

TEST(partly_cached_file_mixes_cached_and_disk_pieces, ALL) {
  // The page cache may hold the file in large folios (up to 2 MiB), evicted
  // whole: the file and the evicted hole are multiples of that.
  constexpr size_t M = 1u << 20;
  TempDir dir;
  const std::string path = dir.file("p.bin");
  const std::string data = random_bytes(8 * M + 77, 32);
  write_file_plain(path, data);
  (void)read_file(path);
  evict(path, 2 * M, 2 * M);  // [2 MiB, 4 MiB) back to the disk only
  Engine eng(config());
  // One whole-file range: its cached prefix (at most 2 MiB), the rest from the disk.
  ReadStats st = read_and_check(eng, path, data, {{0, data.size()}}, "whole");
  if (st.cached_bytes == data.size()) SKIP("posix_fadvise(DONTNEED) evicted nothing here");
  // Where the cached prefix ends is the kernel's: a cached read that meets a
  // readahead mark starts asynchronous readahead, which may refill the hole
  // while the phase runs (a loaded machine sees it). The exact stop at the
  // first miss is checked with an injected miss in the test below.
  CHECK(st.cached_bytes > 0);
  CHECK(st.cached_bytes < data.size());
  CHECK(st.requests > 0);
  // Several ranges: the first wholly cached, the second cached up to where the
  // hole starts (or less), the rest from the disk.
  (void)read_file(path);
  evict(path, 2 * M, 2 * M);
  const std::vector<Want> rs = {{5, 100000}, {M + 3, 2 * M}, {1000, 3000}, {5 * M + 1, M}, {7 * M, M + 77}};
  st = read_and_check(eng, path, data, rs, "ranges");
  uint64_t asked = 0;
  for (const Want& w : rs) asked += w.len;
  CHECK(st.cached_bytes >= 100000 + 3000);
  CHECK(st.cached_bytes <= asked);
  if (st.cached_bytes < asked) CHECK(st.requests > 0);
}

// A file the page cache holds with a hole in it (as the host's proactive
// reclaim leaves one, evicting blocks here and there): the ranges after the
// hole are still read from the page cache, only the hole from the disk. The
// pages come from buffered writes and are never read before, so no readahead
// mark can refill the hole while the phase runs; the parts around the hole
// are held in the page cache.
TEST(ranges_after_a_hole_in_the_cache_are_read_from_the_cache, ALL) {
  constexpr size_t M = 1u << 20;
  TempDir dir;
  const std::string path = dir.file("h.bin");
  const std::string data = random_bytes(8 * M + 77, 36);
  write_file_plain(path, data);
  CachePin head(path, 0, 2 * M), tail(path, 4 * M);
  evict(path, 2 * M, 2 * M);  // [2 MiB, 4 MiB): the disk's only (written back first)
  Engine eng(config());
  // sorted: cached, cached, in the hole, cached, straddling the hole's end, cached
  const std::vector<Want> rs = {{5 * M + 1, M}, {5, 100000}, {2 * M + 3, 300001}, {7 * M, M + 77},
                                {1000, 3000}, {4 * M - 4096, 8192}};
  ReadStats st = read_and_check(eng, path, data, rs, "hole");
  // all but the hole's range and the first page of the straddling one (its
  // first step is not wholly cached: all of it from the disk)
  CHECK_EQ(st.cached_bytes, static_cast<uint64_t>(M + 100000 + (M + 77) + 3000));
  CHECK(st.requests > 0);
  CHECK_EQ(eng.backends_created(), 1u);
}

TEST(injected_short_cache_splits_a_range_at_any_byte, ALL) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  const std::string data = random_bytes(kSize, 33);
  write_file_plain(path, data);
  CachePin pin(path);
  Engine eng(config());
  for (int64_t cut : {1, 1000, 4096, 65537, 99999}) {
    fault::clear();
    fault::arm(short_rule(Op::ReadCached, 1, cut, 1));  // the first range: only `cut` bytes cached
    ReadStats st = read_and_check(eng, path, data, {{5, 100000}, {200000, 5000}}, "short");
    CHECK_EQ(fault::fired(), 1u);
    // the rest of the first range from the disk, the second range from the page cache
    CHECK_EQ(st.cached_bytes, static_cast<uint64_t>(cut) + 5000);
    CHECK(st.requests > 0);
  }
}

// The step-by-step cachestat of the page-cache phase (RangeReader::cached_pages)
// can come short on a wholly cached file (a kernel's miscount, measured on
// Linux 6.18): one short answer is asked again and the read stays in the page
// cache; two in a row send that range to the disk, the ranges after it still
// from the page cache, also when the question about the rest of the call
// that follows such a miss comes short once (a third short answer); a kernel
// that cannot say leaves it to the non-blocking reads.
TEST(a_short_cache_count_is_asked_again_before_the_disk_is_read, ALL) {
  TempDir dir;
  const std::string path = dir.file("q.bin");
  const std::string data = random_bytes(kSize, 39);
  write_file_plain(path, data);
  CachePin pin(path);
  std::vector<Want> sorted = kRanges;
  std::sort(sorted.begin(), sorted.end(), [](const Want& x, const Want& y) { return x.off < y.off; });
  uint64_t total = 0;
  for (const Want& w : kRanges) total += w.len;
  // Query 1 asks about all the ranges at once, then one query per step of
  // each range in file order (with a CRC, steps of 256 KiB).
  const uint64_t step = 256u << 10;
  uint64_t query = 2;
  for (uint64_t i = 0; i < sorted.size(); ++i) {
    for (uint64_t times : {1u, 2u, 3u}) {
      if (times == 3 && i + 1 == sorted.size()) continue;  // no rest after the last range to ask about
      Engine eng(config());
      fault::clear();
      const uint64_t pages = (sorted[i].off + sorted[i].len + 4095) / 4096 - sorted[i].off / 4096;
      const int64_t cached = pages > 1 && i % 2 ? 4096 : 0;  // none of the step's pages, or one, said cached
      fault::arm(short_rule(Op::CacheQuery, query, cached, times));
      const std::string what = "range " + std::to_string(i) + ", " + std::to_string(times) + " short";
      ReadStats st = read_and_check(eng, path, data, kRanges, what.c_str());
      CHECK_EQ(fault::fired(), times);
      if (times == 1) {
        CHECK_MSG(st.cached_bytes == total, what + ": cached " + std::to_string(st.cached_bytes));
        CHECK_EQ(st.requests, 0u);
        CHECK_EQ(eng.backends_created(), 0u);
      } else {
        CHECK_MSG(st.cached_bytes == total - sorted[i].len, what + ": cached " + std::to_string(st.cached_bytes));
        CHECK(st.requests > 0);
      }
    }
    query += (sorted[i].len + step - 1) / step;
  }
  for (int err : {ENOSYS, EPERM}) {
    Engine eng(config());
    fault::clear();
    fault::arm(rule(Op::CacheQuery, 1, err, 0));
    ReadStats st = read_and_check(eng, path, data, kRanges, std::strerror(err));
    CHECK_EQ(fault::fired(), query - 1);  // every query made once
    CHECK_EQ(st.cached_bytes, total);
    CHECK_EQ(st.requests, 0u);
  }
  fault::clear();
}

TEST(rwf_nowait_refused_falls_back_to_the_normal_path, ALL) {
  TempDir dir;
  const std::string path = dir.file("r.bin");
  const std::string data = random_bytes(kSize, 34);
  write_file_plain(path, data);
  (void)read_file(path);
  for (int err : {EOPNOTSUPP, EINVAL, EAGAIN}) {
    Engine eng(config());
    fault::clear();
    fault::arm(rule(Op::ReadCached, 1, err, 0));
    ReadStats st = read_and_check(eng, path, data, kRanges, std::strerror(err));
    // refused: one try per call; a miss (the file cached all the same): one per range
    CHECK_EQ(fault::fired(), err == EAGAIN ? kRanges.size() : 1u);
    CHECK_EQ(st.cached_bytes, 0u);
    CHECK(st.requests > 0);
    CHECK_EQ(eng.backends_created(), 1u);
  }
}

TEST(a_failing_cached_read_is_an_io_error_naming_the_file, ONCE) {
  TempDir dir;
  const std::string path = dir.file("e.bin");
  const std::string data = random_bytes(100000, 35);
  write_file_plain(path, data);
  (void)read_file(path);
  Engine eng(config());
  const size_t fds = count_fds();
  for (Op op : {Op::ReadCached, Op::Read}) {
    fault::clear();
    fault::arm(rule(op, 1, EIO));
    std::string out(data.size(), '\0');
    bool threw = false;
    try {
      fastckpt::read_ranges(eng, path, {{&out[0], out.size(), 0}});
    } catch (const IoError& e) {
      threw = true;
      CHECK_EQ(e.err(), EIO);
      CHECK_CONTAINS(std::string(e.what()), path);
    }
    CHECK(threw);
    CHECK_EQ(fault::fired(), 1u);
    CHECK_EQ(count_fds(), fds);
  }
  fault::clear();
  CHECK_BYTES(load(eng, path, data.size()), data);  // and the next read works
}

// Destinations (fresh memory) are faulted in ahead of the reads by a helper
// thread (config prefault): those read straight from the disk (O_DIRECT,
// page-aligned) and those copied out of staging (a destination the disk cannot
// write to directly, `shift` bytes off a page). The same bytes and CRCs with it
// and without it, the helper leaving alone what the first reads fault in
// themselves, and a read that fails part way stops and joins the helper
// before read_ranges returns (the caller may free the memory at once).
TEST(prefaulted_destinations_read_the_same_bytes_and_fail_cleanly, ALL) {
  TempDir dir;
  const std::string path = dir.file("p.bin");
  const size_t n = (40u << 20) + 4096;  // above the helper's threshold (16 MiB)
  const std::string data = random_bytes(n, 37);
  write_file_plain(path, data);
  for (size_t shift : {size_t(0), size_t(64)})
  for (bool prefault : {true, false}) {
    EngineConfig cfg = config(1u << 20, 4, 4);
    cfg.prefault = prefault;
    Engine eng(cfg);
    evict(path);
    void* mem = ::mmap(nullptr, n + shift, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(mem != MAP_FAILED);
    char* dst = static_cast<char*>(mem) + shift;
    uint32_t crc = 0;
    ReadStats st = fastckpt::read_ranges(eng, path, {{dst, n, 0, &crc}});
    CHECK_BYTES(std::string(dst, n), data);
    CHECK_MSG(crc == zcrc(data, 0, n), prefault ? "CRC with prefault" : "CRC without prefault");
    if (variant().direct) CHECK_EQ(st.direct_requests > 0, shift == 0);
    // The first queue_depth reads (4 x 1 MiB) fault their destinations in
    // themselves; the helper starts after them, so the two never fault the
    // same pages there.
    if (prefault) CHECK_MSG(st.prefaulted_bytes <= n - (4u << 20), std::to_string(st.prefaulted_bytes));
    else CHECK_EQ(st.prefaulted_bytes, 0u);
    ::munmap(mem, n + shift);
    CHECK_POOL_FULL(eng);

    // A disk read failing part way: an IoError, then the memory goes away at once.
    evict(path);
    mem = ::mmap(nullptr, n + shift, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(mem != MAP_FAILED);
    fault::clear();
    fault::arm(rule(Op::Read, 3, EIO));
    bool threw = false;
    try {
      fastckpt::read_ranges(eng, path, {{static_cast<char*>(mem) + shift, n, 0}});
    } catch (const IoError& e) {
      threw = true;
      CHECK_EQ(e.err(), EIO);
    }
    fault::clear();
    CHECK(threw);
    ::munmap(mem, n + shift);
    CHECK_POOL_FULL(eng);
  }
}

// Reads all of `path` (which holds `data`) into fresh memory on huge pages,
// 2 MiB-aligned and advised MADV_HUGEPAGE as a load's own storages are, with
// read_ranges' fresh_huge as given, the file put in the page cache first
// (`cached`) or evicted; checks the bytes and the CRC, gives the memory back
// and returns the read's statistics.
ReadStats fresh_huge_read(Engine& eng, const std::string& path, const std::string& data, bool cached,
                          bool fresh_huge = true) {
  const size_t n = data.size();
  if (cached) {
    std::string back(n, '\0');
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ(::pread(fd, &back[0], n, 0), static_cast<ssize_t>(n));  // into the page cache
    ::close(fd);
  } else {
    evict(path);
  }
  const size_t huge = 2u << 20;
  void* mem = ::mmap(nullptr, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  char* dst = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(mem) + huge - 1) / huge * huge);
  (void)::madvise(dst, n, MADV_HUGEPAGE);
  uint32_t crc = 0;
  ReadStats st = fastckpt::read_ranges(eng, path, {{dst, n, 0, &crc}}, -1, fresh_huge);
  CHECK_BYTES(std::string(dst, n), data);
  CHECK_EQ(crc, zcrc(data, 0, n));
  ::munmap(mem, n + huge);
  return st;
}

// Reads into destinations allocated for them on huge pages (fresh_huge) judge
// the huge pages the prefault helper faults in: where they come slower than
// the threshold, the destinations it has not reached are advised small pages
// and the process remembers it; the bytes are the file's either way. The
// threshold is set by the test-only FASTCKPT_TEST_SLOW_HUGE_BPS: 1e18 makes
// every window slow, 0 none.
TEST(slow_huge_pages_move_the_rest_of_a_fresh_read_to_small_pages, ALL) {
  TempDir dir;
  const std::string path = dir.file("h.bin");
  const size_t n = 48u << 20;  // several judging windows (16 MiB) past the first reads
  const std::string data = random_bytes(n, 41);
  write_file_plain(path, data);
  struct Case {
    const char* bps;
    bool fresh_huge;
    bool slow;
  };
  for (const Case& c : {Case{"1e18", true, true}, Case{"0", true, false}, Case{"1e18", false, false}}) {
    ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", c.bps, 1);
    fastckpt::reset_huge_pages_verdict();
    Engine eng(config(1u << 20, 4, 4));
    const ReadStats st = fresh_huge_read(eng, path, data, false, c.fresh_huge);
    const fastckpt::HugeVerdict v = fastckpt::huge_pages_verdict();
    // A read that stages kHugeJudgeMin bytes through the pool makes it judge
    // the huge pages of its own buffers (test_pool), whose slow verdict counts too.
    const bool pool_slow = eng.pool().huge_verdict() == 2;
    CHECK_EQ(v.slow_seen, c.slow || pool_slow);
    CHECK_EQ(fastckpt::prefer_huge_pages(), !(c.slow || pool_slow));
    if (c.slow) {
      // every window slow: the first ends at its first step (its budget is nil), and the rest moves
      CHECK_EQ(v.bytes, fastckpt::kHugeJudgeStep);
      CHECK_MSG(st.small_paged_bytes > 0 && st.small_paged_bytes <= n - v.bytes, std::to_string(st.small_paged_bytes));
    } else {
      CHECK_EQ(st.small_paged_bytes, 0u);
    }
    CHECK_POOL_FULL(eng);
  }
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
  fastckpt::reset_huge_pages_verdict();
}

// A large fresh read judges its first destinations before anything is read,
// from the disk or from the page cache (where no prefault helper runs):
// where huge pages are slow, everything after that first window is advised
// small pages before a read or a copy faults it.
TEST(a_large_fresh_read_judges_its_first_window_before_reading, ALL) {
  TempDir dir;
  const std::string path = dir.file("f.bin");
  const size_t n = 40u << 20;  // at least the 32 MiB that judge_first wants
  const std::string data = random_bytes(n, 43);
  write_file_plain(path, data);
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "1e18", 1);
  for (bool cached : {false, true}) {
    fastckpt::reset_huge_pages_verdict();
    Engine eng(config(1u << 20, 4, 4));
    const ReadStats st = fresh_huge_read(eng, path, data, cached);
    const fastckpt::HugeVerdict v = fastckpt::huge_pages_verdict();
    CHECK(v.slow_seen);
    CHECK_EQ(v.bytes, fastckpt::kHugeJudgeStep);  // slow at its first step: the window ends there
    // the first window, then everything after it advised small pages: nothing left to judge
    CHECK_MSG(v.bytes + st.small_paged_bytes == n,
              std::to_string(v.bytes) + " + " + std::to_string(st.small_paged_bytes));
    if (cached && st.cached_bytes == n) CHECK_EQ(st.backend, std::string("page cache"));  // no helper ran
    CHECK_POOL_FULL(eng);
  }
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
  fastckpt::reset_huge_pages_verdict();
}

// Where the first window is fast and a later one slow (the first free huge
// pages were still backed), the later window moves the rest: judged in the
// page-cache phase for a cached file (no prefault helper runs there), by the
// helper for a disk read.
TEST(a_later_slow_window_moves_the_rest_of_a_fresh_read_to_small_pages, ALL) {
  TempDir dir;
  const std::string path = dir.file("w.bin");
  const size_t n = 72u << 20;
  const std::string data = random_bytes(n, 47);
  write_file_plain(path, data);
  ::setenv("FASTCKPT_TEST_SLOW_HUGE_BPS", "0,1e18", 1);  // the first window fast, the others slow
  for (bool cached : {true, false}) {
    fastckpt::reset_huge_pages_verdict();
    Engine eng(config(1u << 20, 4, 4));
    const ReadStats st = fresh_huge_read(eng, path, data, cached);
    // The helper is best effort: on a loaded machine a disk read can finish before it has faulted a
    // second window in; then there is nothing to judge (the page-cache phase judges in the caller's
    // thread: always).
    if (!cached && st.prefaulted_bytes <= fastckpt::kHugeJudgeBytes) {
      CHECK_EQ(st.small_paged_bytes, 0u);
      continue;
    }
    CHECK_MSG(fastckpt::huge_pages_verdict().slow_seen,
              std::string(cached ? "cached" : "disk") + ": cached " + std::to_string(st.cached_bytes) +
                  ", prefaulted " + std::to_string(st.prefaulted_bytes) + ", direct requests " +
                  std::to_string(st.direct_requests) + ", requests " + std::to_string(st.requests));
    // after the first window (16 MiB, fast) and the second (slow, ended at its first step): the rest,
    // or what the helper had not reached
    const uint64_t second = fastckpt::huge_pages_verdict().bytes;
    CHECK_MSG(second > 0 && second < fastckpt::kHugeJudgeBytes, std::to_string(second));
    CHECK_MSG(st.small_paged_bytes > 0 && st.small_paged_bytes <= n - fastckpt::kHugeJudgeBytes - second,
              std::to_string(st.small_paged_bytes));
    if (cached && st.cached_bytes == n) CHECK_EQ(st.small_paged_bytes, n - fastckpt::kHugeJudgeBytes - second);
    CHECK_POOL_FULL(eng);
  }
  ::unsetenv("FASTCKPT_TEST_SLOW_HUGE_BPS");
  fastckpt::reset_huge_pages_verdict();
}

// A file of which nothing is cached goes straight to the disk path: no
// RWF_NOWAIT try, whose miss would start the kernel's readahead (up to
// read_ahead_kb of the file read into the page cache for nothing).
TEST(an_uncached_file_starts_no_readahead, ALL) {
  TempDir dir;
  const std::string path = dir.file("u.bin");
  const size_t n = 4u << 20;
  const std::string data = random_bytes(n, 38);
  write_file_plain(path, data);
  const int probe = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(probe >= 0);
  if (fastckpt::sys::cached_pages_raw(probe, 0, n, path) < 0) {
    ::close(probe);
    SKIP("cachestat(2) is not available on this kernel");
  }
  evict(path);
  if (fastckpt::sys::cached_pages_raw(probe, 0, n, path) != 0) {
    ::close(probe);
    SKIP("posix_fadvise(DONTNEED) evicted nothing here");
  }
  Engine eng(config());
  ReadStats st = read_and_check(eng, path, data, {{0, 100000}, {200000, 5000}, {3000000, 1000000}}, "uncached");
  CHECK_EQ(st.cached_bytes, 0u);
  CHECK(st.requests > 0);
  const int64_t after = fastckpt::sys::cached_pages_raw(probe, 0, n, path);
  ::close(probe);
  if (variant().direct) CHECK_EQ(after, 0);  // buffered reads fill the cache themselves
}

FCT_MAIN()
