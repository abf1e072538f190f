#include "reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <system_error>
#include <thread>

#include "crc32.h"
#include "error.h"
#include "first_touch.h"
#include "held_buffers.h"
#include "io_queue.h"
#include "sys.h"

namespace fastckpt {

namespace {

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

// A staged piece of a range: `len` bytes at file offset `off`, copied to `dst`
// out of its job's staging buffer.
struct Part {
  char* dst;
  uint64_t off;
  uint64_t len;
  int64_t piece = -1;  // its CrcPiece, when its range wants a CRC
};

// One read request: straight into a destination (direct_dst) or into a
// staging buffer that holds the parts [part_begin, part_end).
struct Job {
  uint64_t off = 0;
  uint64_t len = 0;      // bytes requested from the file
  uint64_t need = 0;     // bytes that must arrive (the rest may lie past EOF)
  char* direct_dst = nullptr;
  int64_t piece = -1;    // a direct job's CrcPiece, when its range wants a CRC
  size_t part_begin = 0, part_end = 0;
  uint64_t buf_off = 0;  // a staged job's place in its group's staging slice
  uint64_t gap_off = 0;  // the place there of the gap read through before it, if any
};

// One piece (a direct job or a staged part) of a range whose CRC was asked
// for. A range's pieces are consecutive in the list and in file order, so
// folding the list in order with crc32_combine gives each range's CRC.
struct CrcPiece {
  uint32_t* out;  // the range's ReadRange::crc
  uint64_t len;
  uint32_t crc;
  bool first;     // the range's first piece
};

constexpr uint64_t kPrefaultMin = 16u << 20;   // destination bytes of a read_ranges call worth a prefault thread
constexpr uint64_t kPrefaultPart = 64u << 10;  // staged parts smaller than this are left to the copy
// A staged part is copied out and checksummed in pieces this big, so that the
// CRC reads what the copy just wrote while it is still in the cache.
constexpr uint64_t kCrcPiece = 256u << 10;
// The page cache phase reads a range in steps this big, each only when wholly cached.
constexpr uint64_t kCachedPiece = 1u << 20;
constexpr uint64_t kPage = 4096;

// The ranges left for the disk after the page cache, in file order; cont[i]:
// range i continues one whose cached prefix was read (its first byte is not
// read here, its CRC so far is already in *crc).
struct Pending {
  std::vector<ReadRange> ranges;
  std::vector<char> cont;
};

// Jobs that follow each other in the file, read by one request: a vectored
// read (preadv) into each job's destination or staging slice, and the gaps
// between them (a record's header and padding) into staging too, so that a
// file of small tensors, each a direct body between windows of a block or
// two, is read in requests as large as a file of large tensors is.
struct Group {
  size_t begin = 0, end = 0;  // its jobs
  size_t segments = 0;        // of the vectored read: its jobs and the gaps between them
  uint64_t len = 0;           // bytes requested: its jobs' and gaps' together
  uint64_t staged = 0;        // bytes of staging its staged jobs and gaps take (each rounded up to a page)
  int buf = -1;               // the staging buffer of its staged jobs, while in flight
  uint64_t base = 0;          // where its slice of that buffer starts
};

// The reads planned for the pending ranges.
struct Plan {
  std::vector<Job> jobs;
  std::vector<Part> parts;
  std::vector<CrcPiece> pieces;
  std::vector<Group> groups;
};

constexpr size_t kMaxSegments = 256;  // a vectored read's segments at most (IOV_MAX is 1024)

// Groups the planned jobs (in file order) into requests of at most `cap`
// bytes: a job joins the group before it when it starts where that group
// ends or within kCoalesceGap of it (the gap is read into staging and
// dropped: a request beats reading a few KiB less). A job whose bytes past
// `need` may lie beyond the end of the file (a window rounded up to a block)
// can still be followed: the next job's bytes must arrive, and they lie past
// it, so the file holds all of it; only a request's last job may come up
// short. The group's staging layout is laid out here, once: a staged job or
// gap takes its length rounded up to a page of its group's staging slice (the
// slices' alignment), in file order (Job::buf_off, Job::gap_off).
void group_jobs(Plan& p, uint64_t cap) {
  for (size_t i = 0; i < p.jobs.size(); ++i) {
    Job& j = p.jobs[i];
    const uint64_t staged = j.direct_dst ? 0 : round_up(j.len, kPage);
    if (!p.groups.empty()) {
      Group& g = p.groups.back();
      const Job& last = p.jobs[g.end - 1];
      const uint64_t end = last.off + last.len;
      const uint64_t gap = j.off - end, gap_staged = round_up(gap, kPage);
      if (j.off >= end && gap <= kCoalesceGap && j.need > 0 && g.len + gap + j.len <= cap &&
          g.staged + gap_staged + staged <= cap && g.segments + (gap > 0) + 1 <= kMaxSegments) {
        g.end = i + 1;
        g.segments += (gap > 0) + 1;
        g.len += gap + j.len;
        j.gap_off = g.staged;
        j.buf_off = g.staged + gap_staged;
        g.staged += gap_staged + staged;
        continue;
      }
    }
    Group g;
    g.begin = i;
    g.end = i + 1;
    g.segments = 1;
    g.len = j.len;
    g.staged = staged;
    j.buf_off = 0;
    p.groups.push_back(g);
  }
}

// Plans the reads: direct jobs for the aligned bodies of ranges whose
// destination has its offset's phase (`direct`: file offsets to `a`,
// memory to `mem_a`), staging windows of one buffer (`bs` bytes) for the
// rest, a window taking in the next range when it starts inside it or within
// kCoalesceGap of its end and fits.
class Planner {
 public:
  Planner(bool direct, uint64_t a, uint64_t mem_a, uint64_t bs) : direct_(direct), a_(a), mem_a_(mem_a), bs_(bs) {}

  Plan plan(const Pending& pending) {
    for (size_t ri = 0; ri < pending.ranges.size(); ++ri) add(pending.ranges[ri], !pending.cont[ri]);
    close_window();
    return std::move(p_);
  }

 private:
  // `starts`: the range's first byte is read here (not from the cache).
  // The aligned body of a range whose destination has the same phase as its
  // offset (dst - off a multiple of the file alignment, the body's first byte
  // on a memory-aligned address) is read straight into the destination: an
  // aligned range has no head, a range of a file whose tensors are not
  // aligned (safetensors' own, torch.save's) into memory allocated at its
  // offset's phase has a head and a tail of less than a block each, which go
  // through staging with the neighbouring range's (one window reads the block
  // they share). Everything else goes through staging.
  void add(const ReadRange& r, bool starts) {
    char* dst = static_cast<char*>(r.dst);
    const uint64_t head = (a_ - r.off % a_) % a_;
    uint64_t body = 0;
    if (direct_ && r.len > head && (reinterpret_cast<uintptr_t>(dst) - r.off) % a_ == 0 &&
        reinterpret_cast<uintptr_t>(dst + head) % mem_a_ == 0)
      body = round_down(r.len - head, a_);
    if (body == 0) {
      stage(r, dst, r.off, r.len, starts);
      return;
    }
    if (head > 0) stage(r, dst, r.off, head, starts);
    close_window();
    for (uint64_t done = 0; done < body; done += bs_) {
      Job j;
      j.off = r.off + head + done;
      j.len = j.need = body - done < bs_ ? body - done : bs_;
      j.direct_dst = dst + head + done;
      j.piece = new_piece(r, j.len, starts && head == 0 && done == 0);
      p_.jobs.push_back(j);
    }
    const uint64_t tail = r.len - head - body;
    if (tail > 0) stage(r, dst + head + body, r.off + head + body, tail, starts);
  }

  // [off, off + left) of range r (into dst on) through staging windows.
  void stage(const ReadRange& r, char* dst, uint64_t off, uint64_t left, bool starts) {
    while (left > 0) {
      if (open_) {
        // Join the open window when the range starts inside it or near its
        // end (reading a small gap beats another request) and fits in it.
        // (An earlier, longer range may have moved the window past `off`.)
        const Job& w = p_.jobs.back();
        if (off < w.off || off >= w.off + bs_ || (off > win_end_ && off - win_end_ > kCoalesceGap)) close_window();
      }
      if (!open_) {
        Job j;
        j.off = round_down(off, a_);
        j.part_begin = p_.parts.size();
        p_.jobs.push_back(j);
        open_ = true;
        win_end_ = off;
      }
      Job& j = p_.jobs.back();
      uint64_t room = j.off + bs_ - off;
      uint64_t take = left < room ? left : room;
      p_.parts.push_back(Part{dst, off, take, new_piece(r, take, starts && off == r.off)});
      if (off + take > win_end_) win_end_ = off + take;
      dst += take;
      off += take;
      left -= take;
      if (win_end_ == j.off + bs_) close_window();
    }
  }

  int64_t new_piece(const ReadRange& r, uint64_t len, bool first) {
    if (!r.crc) return -1;
    p_.pieces.push_back(CrcPiece{r.crc, len, 0, first});
    return static_cast<int64_t>(p_.pieces.size() - 1);
  }

  void close_window() {
    if (!open_) return;
    Job& j = p_.jobs.back();
    j.need = win_end_ - j.off;
    j.len = round_up(win_end_, a_) - j.off;
    j.part_end = p_.parts.size();
    open_ = false;
  }

  const bool direct_;
  const uint64_t a_, mem_a_, bs_;
  Plan p_;
  bool open_ = false;     // the last job is a staging window still taking parts
  uint64_t win_end_ = 0;  // end of the furthest part in the open window
};

// Copies a staged job's parts out of its staging buffer `src`, checksumming
// those whose range wants a CRC piece by piece right after each copy.
void copy_out(const Job& j, const char* src, const std::vector<Part>& parts, std::vector<CrcPiece>& pieces) {
  for (size_t p = j.part_begin; p < j.part_end; ++p) {
    const Part& part = parts[p];
    const char* from = src + (part.off - j.off);
    if (part.piece < 0) {
      std::memcpy(part.dst, from, part.len);
      continue;
    }
    uint32_t crc = 0;
    for (uint64_t done = 0; done < part.len; done += kCrcPiece) {
      const uint64_t k = part.len - done < kCrcPiece ? part.len - done : kCrcPiece;
      std::memcpy(part.dst + done, from + done, k);
      crc = crc32(crc, part.dst + done, k);
    }
    pieces[part.piece].crc = crc;
  }
}

// A reader's staging: slices of the pool's buffers, taken in order, so that
// the small windows of a file whose tensors are not aligned (a tensor's tail
// and the next one's head: a block or two) share a buffer instead of holding
// one each, which would bound the reads in flight by the buffers a reader may
// hold. A buffer is reused once every read into it was reaped: the current
// one from its start, another one by the next window that needs a buffer.
// Slices start on a page: O_DIRECT's memory alignment is at most that
// wherever the reader reads O_DIRECT (BufferPool::fits_direct_io).
class Slices {
 public:
  // {buffer, offset} of `len` bytes (at most a buffer) for a read, or buffer -1
  // when none is to be had before a reap (HeldBuffers::try_take).
  std::pair<int, uint64_t> take(BufferPool& pool, const IoQueue& q, size_t limit, uint64_t len) {
    const uint64_t bs = pool.buffer_size();
    if (cur_ >= 0 && cur_off_ + len > bs) retire();
    if (cur_ < 0) {
      const int b = bufs_.try_take(pool, q, limit);
      if (b < 0) return {-1, 0};
      if (users_.size() <= static_cast<size_t>(b)) users_.resize(static_cast<size_t>(b) + 1, 0);
      cur_ = b;
      cur_off_ = 0;
    }
    const uint64_t off = cur_off_;
    cur_off_ += round_up(len, kPage);
    ++users_[static_cast<size_t>(cur_)];
    return {cur_, off};
  }
  // A read into buffer b was reaped (its bytes copied out).
  void done(int b) {
    if (--users_[static_cast<size_t>(b)] > 0) return;
    if (b == cur_) cur_off_ = 0;
    else bufs_.put_back(b);
  }
  HeldBuffers& held() { return bufs_; }

 private:
  void retire() {
    if (users_[static_cast<size_t>(cur_)] == 0) bufs_.put_back(cur_);
    cur_ = -1;
  }
  HeldBuffers bufs_;
  std::vector<unsigned> users_;  // by buffer index: reads in flight into it
  int cur_ = -1;                 // the buffer slices are taken from now
  uint64_t cur_off_ = 0;
};

// One read_ranges call. Whatever it holds (the descriptor, a backend, staging
// buffers, the prefault helper) is given back by cleanup(), on success and on
// every error: in-flight requests are reaped before a buffer is freed or the
// descriptor closed.
class RangeReader {
 public:
  RangeReader(Engine& engine, const std::string& path, bool fresh_huge)
      : engine_(engine), cfg_(engine.config()), pool_(engine.pool()), path_(path), fresh_huge_(fresh_huge) {}
  ~RangeReader() { cleanup(); }
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;

  ReadStats run(const std::vector<ReadRange>& ranges, int same_file_fd) {
    const double t0 = now_seconds();
    open_file(same_file_fd);
    Pending pending = check_and_sort(ranges);
    if (fresh_huge_ && cfg_.prefault && st_.bytes >= kHugeJudgeMin) {
      judge_first(pending);
      judging_cached_ = !judged_slow_;
    }
    read_cached(pending);
    if (pending.ranges.empty()) {
      cleanup();
      st_.seconds = now_seconds() - t0;
      st_.direct = false;
      st_.backend = "page cache";
      return st_;
    }
    uint64_t a = 1, mem_a = 1;
    prepare_disk(&a, &mem_a);
    plan_ = Planner(direct_, a, mem_a, pool_.buffer_size()).plan(pending);
    group_jobs(plan_, pool_.buffer_size());
    uint64_t staged = 0;  // huge staging pages once a read stages a huge page's worth
    for (const Group& g : plan_.groups) staged += g.staged;
    pool_.expect(staged);
    start_prefault();
    read_jobs();
    for (const CrcPiece& p : plan_.pieces) *p.out = p.first ? p.crc : crc32_combine(*p.out, p.crc, p.len);
    cleanup();
    st_.seconds = now_seconds() - t0;
    st_.direct = direct_;
    return st_;
  }

 private:
  // A new descriptor (O_DIRECT is per open file), on the caller's file if given.
  void open_file(int same_file_fd) {
    const std::string open_path = same_file_fd >= 0 ? "/proc/self/fd/" + std::to_string(same_file_fd) : path_;
    direct_ = cfg_.direct;
    if (direct_) {
      try {
        fd_ = sys::open(open_path, O_RDONLY | O_DIRECT, 0, &path_);
      } catch (const IoError& e) {
        if (e.err() != EINVAL) throw;
        direct_ = false;
      }
    }
    if (fd_ < 0) fd_ = sys::open(open_path, O_RDONLY, 0, &path_);
  }

  // The non-empty ranges in file order, each checked against the file's size;
  // every CRC asked for starts as the CRC of no bytes.
  Pending check_and_sort(const std::vector<ReadRange>& ranges) {
    const uint64_t fsize = sys::file_size(fd_, path_);
    Pending p;
    p.ranges.reserve(ranges.size());
    for (const ReadRange& r : ranges) {
      if (r.crc) *r.crc = 0;  // the CRC of no bytes
      if (r.len == 0) continue;
      if (!r.dst) throw UsageError("read_ranges: null destination");
      if (r.off > fsize || r.len > fsize - r.off) throw TruncatedError(path_, r.off, r.len, fsize);
      p.ranges.push_back(r);
      st_.bytes += r.len;
    }
    std::sort(p.ranges.begin(), p.ranges.end(),
              [](const ReadRange& x, const ReadRange& y) { return x.off < y.off; });
    p.cont.assign(p.ranges.size(), 0);
    return p;
  }

  // Page cache first, range by range in file order: each range's cached
  // prefix is read (in steps, each only when cachestat counts it whole), and
  // what is left of it stays pending for the disk; a range whose cached prefix
  // was read continues from there (`cont`), its CRC so far already in *crc.
  // A miss does not end the phase while the rest of the call's span still
  // holds a CRC step's worth of cached pages (or is wholly cached): a file
  // the page cache holds with holes in it (evicted here and there: on this
  // VM the host's DAMON pageout takes unmapped file pages in scattered
  // blocks) is read from the page cache wherever it still can be, not from
  // the disk from its first hole on. Each miss costs cachestat calls (the
  // step's and the rest's, cached_pages), no read.
  // A file of which nothing is cached skips the phase: a miss of preadv2
  // with RWF_NOWAIT still starts the kernel's readahead of the file's next
  // window (read_ahead_kb, 8 MiB here), read for nothing while the disk path
  // reads the same bytes with O_DIRECT. cachestat(2) asks without reading.
  // Kernels without it: the phase runs, and ends at the first miss; a kernel
  // refusing RWF_NOWAIT ends it too.
  void read_cached(Pending& p) {
    if (p.ranges.empty()) return;
    uint64_t end = 0;
    for (const ReadRange& r : p.ranges) end = std::max(end, r.off + r.len);
    if (sys::cached_pages_raw(fd_, p.ranges.front().off, end - p.ranges.front().off, path_) == 0) return;
    if (direct_) sys::set_direct(fd_, false, path_);
    const size_t n = p.ranges.size();
    size_t kept = 0;  // p.ranges[0, kept): the ranges (or their rests) left for the disk
    size_t i = 0;
    while (i < n) {
      ReadRange& r = p.ranges[i];
      bool refused = false;
      const uint64_t got = read_cached_prefix(r, &refused);
      if (advise_rest_) {  // a window of this range's copies found huge pages slow: the ranges after it too
        advise_rest_ = false;
        for (size_t k = i + 1; k < n; ++k)
          if (sys::advise_small_pages_raw(p.ranges[k].dst, p.ranges[k].len) == 0) small_paged_ += p.ranges[k].len;
      }
      st_.cached_bytes += got;
      ++i;
      if (got == r.len) continue;
      if (got > 0) {
        r.dst = static_cast<char*>(r.dst) + got;
        r.off += got;
        r.len -= got;
        p.cont[i - 1] = 1;
      }
      p.ranges[kept] = r;
      p.cont[kept] = p.cont[i - 1];
      ++kept;
      if (refused || i == n) break;
      // Go on while the rest is wholly cached or holds 256 KiB of cached pages
      // (a cold file's last page, cached by the metadata reads, does not
      // keep the phase going through every range); no cachestat: stop.
      const uint64_t a = round_down(p.ranges[i].off, kPage), e = round_up(end, kPage);
      const uint64_t need = std::min<uint64_t>((e - a) / kPage, kCrcPiece / kPage);
      const int64_t rest = cached_pages(a, e, need);
      if (rest < 0 || static_cast<uint64_t>(rest) < need) break;
    }
    for (; i < n; ++i, ++kept) {  // not tried: the disk's
      p.ranges[kept] = p.ranges[i];
      p.cont[kept] = p.cont[i];
    }
    p.ranges.resize(kept);
    p.cont.resize(kept);
    st_.bytes_read += st_.cached_bytes;
  }

  // Whether every page of [off, off+len) is in the page cache (cachestat);
  // true where the kernel cannot say (the non-blocking read then finds out).
  bool wholly_cached(uint64_t off, uint64_t len) const {
    const uint64_t a = round_down(off, kPage), e = round_up(off + len, kPage);
    const int64_t n = cached_pages(a, e, (e - a) / kPage);
    return n < 0 || static_cast<uint64_t>(n) >= (e - a) / kPage;
  }

  // How many pages of [a, e) (page-aligned) the page cache holds (cachestat;
  // -errno where the kernel cannot say), asked again when the count comes
  // short of `need`: Linux (6.18 here) can count low. Where the first folio
  // of the range is a large one that starts before `a`, and cachestat stops
  // to reschedule after it, the count comes short by as many pages as that
  // folio has before `a`. Measured on a file held in the page cache (mapped
  // and locked) with both CPUs busy: 1 call in 10,000 came short, always by
  // exactly that many pages (1, 3, 14, 15 for starts 1, 3, 14, 255 pages into
  // the file). A wholly cached checkpoint's load then left the page cache at
  // that step and read the rest of the file (up to 17 MB) from the disk. Two
  // such rescheds in a row at the same first folio have not been seen; a
  // range really short of `need` costs one more syscall.
  int64_t cached_pages(uint64_t a, uint64_t e, uint64_t need) const {
    int64_t n = sys::cached_pages_raw(fd_, a, e - a, path_);
    if (n >= 0 && static_cast<uint64_t>(n) < need) n = sys::cached_pages_raw(fd_, a, e - a, path_);
    return n;
  }

  // The bytes of r's cached prefix, copied into r.dst (and their CRC into
  // *r.crc); 0 when its first byte is not cached. *refused: the kernel
  // refused RWF_NOWAIT (the page cache cannot be asked this way at all).
  uint64_t read_cached_prefix(const ReadRange& r, bool* refused) {
    // In kCachedPiece steps (with a CRC: kCrcPiece, each checksummed right
    // after its copy, still in the CPU cache, as the staged pieces are). A
    // step is read only when cachestat says all its pages are cached: a
    // non-blocking read that misses still starts the kernel's readahead, which
    // would read from the disk what the O_DIRECT path then reads again.
    const uint64_t step = r.crc ? kCrcPiece : kCachedPiece;
    uint64_t got = 0;
    uint32_t crc = 0;
    while (got < r.len) {
      const uint64_t want = r.len - got < step ? r.len - got : step;
      if (!wholly_cached(r.off + got, want)) break;
      char* at = static_cast<char*>(r.dst) + got;
      if (judging_cached_) judge_cached(r, got, want);
      const int64_t k = sys::pread_cached(fd_, at, want, static_cast<int64_t>(r.off + got), path_);
      if (k < 0) *refused = true;  // RWF_NOWAIT refused (-1): the normal path for the rest of the call
      if (k <= 0) break;           // not cached (0)
      if (r.crc) crc = crc32(crc, at, static_cast<uint64_t>(k));
      got += static_cast<uint64_t>(k);
      if (static_cast<uint64_t>(k) < want) break;
    }
    if (got > 0 && r.crc) *r.crc = crc;
    return got;
  }

  // The page-cache phase's windows (with fresh_huge_, after judge_first found
  // nothing slow): the step of `want` bytes at `got` into r faulted in before
  // its copy, timed, window by window of kHugeJudgeBytes as the prefault
  // helper does for the disk phase; where a window is slow, the rest of r and
  // every range after it (read_cached) are advised small pages.
  void judge_cached(const ReadRange& r, uint64_t got, uint64_t want) {
    const bool judged = cached_seen_ < judged_window_;  // inside judge_first's window: judged already
    cached_seen_ += want;
    if (judged) return;
    const double cpu0 = sys::thread_cpu_seconds();
    if (sys::populate_write_raw(static_cast<char*>(r.dst) + got, want) < 0) {
      judging_cached_ = false;  // unsupported: the copies fault their pages themselves
      return;
    }
    if (!cached_win_) cached_win_.emplace(windows_judged_++);
    const HugeWindow::State w = cached_win_->add(want, sys::thread_cpu_seconds() - cpu0);
    if (w == HugeWindow::kOpen) return;
    cached_win_.reset();
    if (w == HugeWindow::kSlow) {
      judged_slow_ = true;
      judging_cached_ = false;
      const uint64_t done = got + want;
      if (done < r.len && sys::advise_small_pages_raw(static_cast<char*>(r.dst) + done, r.len - done) == 0)
        small_paged_ += r.len - done;
      advise_rest_ = true;
    }
  }

  // O_DIRECT back on (the cache phase turned it off) where the file allows
  // it and its alignment suits the staging buffers (file offsets to *a, memory
  // to *mem_a); a backend leased.
  void prepare_disk(uint64_t* a, uint64_t* mem_a) {
    if (direct_) {
      try {
        sys::set_direct(fd_, true, path_);
      } catch (const IoError& e) {
        if (e.err() != EINVAL) throw;
        direct_ = false;
      }
    }
    lease_.reset(new BackendLease(engine_.lease()));
    st_.backend = lease_->get().name();
    if (direct_) {
      sys::DioAlign al = sys::dio_alignment(fd_, path_);
      if (!pool_.fits_direct_io(al.mem, al.offset)) {
        sys::set_direct(fd_, false, path_);
        direct_ = false;
      } else {
        *a = al.offset;
        *mem_a = al.mem;
      }
    }
  }

  // Fresh memory costs more to fault in than the disk takes to fill it (on
  // a VM, about half of a load's CPU time). A helper thread faults the
  // destinations in ahead of the reads, in file order, in parallel with the
  // submissions, the copies out of staging and the CRCs: the direct jobs'
  // and the staged parts' of at least kPrefaultPart bytes (memory already
  // resident costs it a page-table walk). It starts after the first
  // queue_depth jobs, which the first submissions fault in themselves, and
  // it skips every direct job submitted before it got there (the submitter
  // moves prefault_next_ on): two threads faulting the same pages cost more
  // than one (page-table lock contention, a second walk; on this VM a tenth
  // of a load's CPU). A read or copy that gets ahead of it faults its pages
  // itself, as without it.
  void start_prefault() {
    const std::vector<Job>& jobs = plan_.jobs;
    const std::vector<Part>& parts = plan_.parts;
    uint64_t fault_bytes = 0;
    for (const Job& j : jobs) {
      if (j.direct_dst) fault_bytes += j.len;
      for (size_t p = j.part_begin; p < j.part_end; ++p)
        if (parts[p].len >= kPrefaultPart) fault_bytes += parts[p].len;
    }
    // The jobs inside judge_first's window that the page-cache phase did not
    // read (it read the first cached_bytes of the same ranges, in the same
    // order): faulted in already, the helper starts after them.
    size_t first = 0;
    const uint64_t ahead = judged_window_ > st_.cached_bytes ? judged_window_ - st_.cached_bytes : 0;
    for (uint64_t left = ahead; first < jobs.size() && left > 0; ++first) {
      const uint64_t n = job_bytes(jobs[first]);
      if (n > left) break;
      left -= n;
    }
    prefault_next_ = std::max(first, std::min<size_t>(jobs.size(), cfg_.queue_depth));
    if (!cfg_.prefault || fault_bytes < kPrefaultMin || prefault_next_ >= jobs.size()) return;
    try {
      prefaulter_ = std::thread([this]() { prefault(); });
    } catch (const std::system_error&) {
      // No thread to be had (a process at its thread limit): the reads fault
      // their pages themselves, as with prefault off.
    }
  }

  // The destination bytes of a job (a direct read's, or its staged parts').
  uint64_t job_bytes(const Job& j) const {
    uint64_t n = j.direct_dst ? j.len : 0;
    for (size_t p = j.part_begin; p < j.part_end; ++p) n += plan_.parts[p].len;
    return n;
  }

  // Faults in the destinations of job `i` (prefault): the bytes, or -1 where
  // the kernel refuses (MADV_POPULATE_WRITE before 5.14).
  int64_t populate(size_t i) const {
    const Job& j = plan_.jobs[i];
    const std::vector<Part>& parts = plan_.parts;
    int64_t done = 0;
    if (j.direct_dst) {
      if (sys::populate_write_raw(j.direct_dst, j.len) < 0) return -1;
      done += static_cast<int64_t>(j.len);
    }
    for (size_t p = j.part_begin; p < j.part_end; ++p) {
      if (parts[p].len < kPrefaultPart) continue;
      if (sys::populate_write_raw(parts[p].dst, parts[p].len) < 0) return -1;
      done += static_cast<int64_t>(parts[p].len);
    }
    return done;
  }

  // With fresh_huge_ and a large read: the first kHugeJudgeBytes of the
  // destinations (in file order) faulted in by the calling thread before
  // anything is read, from the page cache or the disk, timed, a huge page at a
  // time (a HugeWindow ends at the step that spends its budget); where huge pages
  // are slow, every destination byte after that window is advised small pages
  // before a copy or a read faults it. (The helper's windows judge the rest
  // of a disk read later: the first free huge pages are often ones given back
  // moments before, still backed.)
  void judge_first(const Pending& p) {
    HugeWindow win(windows_judged_++);
    HugeWindow::State w = HugeWindow::kOpen;
    size_t i = 0;      // the first range not wholly in the window
    uint64_t in = 0;   // of it, the bytes in the window
    while (i < p.ranges.size() && w == HugeWindow::kOpen) {
      // In steps of a huge page: a slow window ends at the step that spends its budget.
      const ReadRange& r = p.ranges[i];
      const uint64_t step = std::min<uint64_t>({r.len - in, kHugeJudgeStep, kHugeJudgeBytes - win.bytes()});
      const double cpu0 = sys::thread_cpu_seconds();
      if (sys::populate_write_raw(static_cast<char*>(r.dst) + in, step) < 0) break;  // unsupported: the reads fault their pages
      w = win.add(step, sys::thread_cpu_seconds() - cpu0);
      in += step;
      if (in == r.len) {
        ++i;
        in = 0;
      }
    }
    prefaulted_ = win.bytes();
    judged_window_ = win.bytes();  // faulted in: the later windows start after it
    if (w != HugeWindow::kSlow) return;
    judged_slow_ = true;
    for (size_t k = i; k < p.ranges.size(); ++k) {
      const ReadRange& r = p.ranges[k];
      const uint64_t skip = k == i ? in : 0;  // the part of range i already faulted in
      if (skip < r.len && sys::advise_small_pages_raw(static_cast<char*>(r.dst) + skip, r.len - skip) == 0)
        small_paged_ += r.len - skip;
    }
  }

  // The helper thread's loop (start_prefault). With fresh_huge_, it judges
  // the huge pages it faults in, window by window of kHugeJudgeBytes (its own
  // CPU time: the faults' cost, whatever else the machine runs; a HugeWindow
  // per window), and at the first slow one advises every destination it has
  // not reached small pages (small_pages_from).
  void prefault() {
    const std::vector<Job>& jobs = plan_.jobs;
    uint64_t done = 0;
    bool judge = fresh_huge_ && !judged_slow_;
    unsigned nth = windows_judged_;  // the windows judged before the disk phase
    std::optional<HugeWindow> win;
    for (;;) {
      const size_t i = prefault_next_.fetch_add(1);
      if (i >= jobs.size() || stop_prefault_.load(std::memory_order_relaxed)) break;
      const double cpu0 = judge ? sys::thread_cpu_seconds() : 0;
      const int64_t n = populate(i);
      if (n < 0) break;  // unsupported: stop
      done += static_cast<uint64_t>(n);
      if (!judge) continue;
      if (!win) win.emplace(nth++);
      const HugeWindow::State w = win->add(static_cast<uint64_t>(n), sys::thread_cpu_seconds() - cpu0);
      if (w == HugeWindow::kOpen) continue;
      win.reset();
      if (w == HugeWindow::kSlow) {
        small_paged_ += small_pages_from(i + 1);
        judge = false;
      }
    }
    prefaulted_ += done;
  }

  // Advises the destinations of jobs [from, end) small pages (those a read
  // has faulted in meanwhile keep theirs). Returns their bytes.
  uint64_t small_pages_from(size_t from) {
    const std::vector<Job>& jobs = plan_.jobs;
    const std::vector<Part>& parts = plan_.parts;
    uint64_t n = 0;
    for (size_t k = from; k < jobs.size(); ++k) {
      const Job& j = jobs[k];
      if (j.direct_dst && sys::advise_small_pages_raw(j.direct_dst, j.len) == 0) n += j.len;
      for (size_t p = j.part_begin; p < j.part_end; ++p)
        if (parts[p].len >= kPrefaultPart && sys::advise_small_pages_raw(parts[p].dst, parts[p].len) == 0)
          n += parts[p].len;
    }
    return n;
  }

  // Submits every group of jobs and handles each completion while the others
  // are in flight: a direct job's CRC, a staged job's copy out (and CRCs). In
  // flight: up to queue_depth x buffer_size bytes, in up to read_requests()
  // requests (at least one), so that small reads keep the device as busy as
  // large ones; a group with staged jobs also waits for a staging slice.
  void read_jobs() {
    std::vector<Group>& groups = plan_.groups;
    q_.reset(new IoQueue(lease_->get(), cfg_.read_requests()));
    const uint64_t budget = static_cast<uint64_t>(cfg_.queue_depth) * pool_.buffer_size();
    uint64_t in_flight = 0;
    size_t next = 0, finished = 0;
    while (finished < groups.size()) {
      while (next < groups.size() && !q_->full() && (q_->inflight() == 0 || in_flight + groups[next].len <= budget)) {
        if (!submit(next)) break;  // wait for one of our staging buffers to come back
        in_flight += groups[next].len;
        ++next;
      }
      st_.peak_requests = std::max<uint64_t>(st_.peak_requests, q_->inflight());
      Reaped r = q_->reap();
      Group& g = groups[r.tag];
      in_flight -= g.len;
      st_.bytes_read += r.bytes;
      for (size_t k = g.begin; k < g.end; ++k) {
        Job& j = plan_.jobs[k];
        if (j.direct_dst) {
          if (j.piece >= 0) plan_.pieces[j.piece].crc = crc32(0, j.direct_dst, j.need);
        } else {
          copy_out(j, pool_.data(g.buf) + g.base + j.buf_off, plan_.parts, plan_.pieces);
        }
      }
      if (g.buf >= 0) slices_.done(g.buf);
      g.buf = -1;
      ++finished;
    }
  }

  // Submits group `index`: one read, vectored when it has several jobs; false
  // when it needs staging and none of ours is free.
  bool submit(size_t index) {
    Group& g = plan_.groups[index];
    const std::vector<Job>& jobs = plan_.jobs;
    char* staging = nullptr;  // the group's slice (laid out by group_jobs)
    if (g.staged > 0) {
      const std::pair<int, uint64_t> slice = slices_.take(pool_, *q_, cfg_.queue_depth, g.staged);
      if (slice.first < 0) return false;
      g.buf = slice.first;
      g.base = slice.second;
      staging = pool_.data(g.buf) + g.base;
    }
    iov_.clear();
    bool direct = false;
    uint64_t pos = jobs[g.begin].off;  // the file offset the next segment starts at
    for (size_t k = g.begin; k < g.end; ++k) {
      const Job& j = jobs[k];
      if (j.off > pos) {  // a gap read through: into staging, dropped
        iov_.push_back(iovec{staging + j.gap_off, j.off - pos});
        st_.staged_bytes += j.off - pos;
      }
      pos = j.off + j.len;
      if (j.direct_dst) {
        iov_.push_back(iovec{j.direct_dst, j.len});
        direct = true;
        ++st_.direct_requests;
      } else {
        st_.staged_bytes += j.len;
        iov_.push_back(iovec{staging + j.buf_off, j.len});
      }
    }
    if (direct) {
      // These reads fault their destinations in themselves: the helper skips them.
      size_t pf = prefault_next_.load(std::memory_order_relaxed);
      while (pf < g.end && !prefault_next_.compare_exchange_weak(pf, g.end, std::memory_order_relaxed)) {
      }
    }
    const Job& last = jobs[g.end - 1];
    IoRequest req;
    req.kind = IoRequest::Read;
    req.fd = fd_;
    req.off = static_cast<int64_t>(jobs[g.begin].off);
    req.len = g.len;
    req.tag = index;
    req.buf_index = g.buf;  // (-1 without staging) a fixed buffer for a plain read; quarantined if never reaped
    if (iov_.size() == 1) {
      req.buf = static_cast<char*>(iov_[0].iov_base);
    } else {
      req.iov = iov_.data();
      req.iovcnt = static_cast<unsigned>(iov_.size());
      ++st_.vectored_requests;
    }
    q_->submit(req, &path_, g.len - last.len + last.need);
    ++st_.requests;
    return true;
  }

  void cleanup() noexcept {
    stop_prefault_ = true;
    if (prefaulter_.joinable()) prefaulter_.join();
    st_.prefaulted_bytes = prefaulted_;
    st_.small_paged_bytes = small_paged_;
    std::vector<int> unreaped;
    if (q_) {
      q_->drain();
      unreaped = q_->unreaped_buffers();
      if (q_->broken() && lease_) lease_->discard();
    }
    slices_.held().release(pool_, unreaped);
    q_.reset();
    lease_.reset();
    sys::close_quiet(fd_);
    fd_ = -1;
  }

  Engine& engine_;
  const EngineConfig& cfg_;
  BufferPool& pool_;
  const std::string& path_;
  ReadStats st_;
  int fd_ = -1;
  bool direct_ = false;
  Plan plan_;
  std::unique_ptr<BackendLease> lease_;  // only when something is left for the disk
  Slices slices_;
  std::vector<iovec> iov_;  // the request being submitted (IoQueue copies it)
  std::unique_ptr<IoQueue> q_;
  std::thread prefaulter_;
  std::atomic<bool> stop_prefault_{false};
  // The prefault helper's next job; the submitter moves it past every direct
  // job it submits (whose pages the read then faults in itself), so that the
  // two never fault the same destination.
  std::atomic<size_t> prefault_next_{0};
  uint64_t prefaulted_ = 0;  // written by the helper, read after it is joined
  uint64_t small_paged_ = 0;  // likewise
  bool judged_slow_ = false;  // judge_first or the page-cache phase found huge pages slow
  // The page-cache phase's judging (judge_cached).
  bool judging_cached_ = false;
  bool advise_rest_ = false;
  std::optional<HugeWindow> cached_win_;  // the page-cache phase's open window
  unsigned windows_judged_ = 0;  // by judge_first and judge_cached (the helper counts on from it)
  uint64_t judged_window_ = 0;    // the destination bytes judge_first faulted in (file order)
  uint64_t cached_seen_ = 0;      // the bytes judge_cached has seen
  const bool fresh_huge_;
};

}  // namespace

ReadStats read_ranges(Engine& engine, const std::string& path, const std::vector<ReadRange>& ranges,
                      int same_file_fd, bool fresh_huge) {
  RangeReader reader(engine, path, fresh_huge);
  return reader.run(ranges, same_file_fd);
}

}  // namespace fastckpt
