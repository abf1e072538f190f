#include "sys.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "error.h"
#include "fault.h"

namespace fastckpt {
namespace sys {

using fault::Op;

namespace {
constexpr int kMaxRetries = 100000;  // EINTR/EAGAIN storms, real or injected

bool retryable(int err) { return err == EINTR || err == EAGAIN; }

// Consults the fault hook before a synchronous call: returns true when the
// call should be retried as after EINTR, throws for an injected failure.
// `report` names the file in the error when it differs from `path`.
bool injected(Op op, const std::string& path, const char* name, int& tries, int64_t off = -1, uint64_t len = 0,
              const std::string* report = nullptr) {
  fault::Action a = fault::on(op, path);
  if (!a.err) return false;
  if (retryable(a.err) && ++tries < kMaxRetries) return true;
  throw_io(a.err, name, report ? *report : path, off, len);
}

// call() retried while it fails with EINTR (kMaxRetries at most, injected
// ones counted too), the fault hook consulted before each try; returns its
// last result, errno set when that is negative.
template <class Call>
int64_t retrying(Op op, const std::string& path, const char* name, Call call, int64_t off = -1, uint64_t len = 0) {
  int tries = 0;
  for (;;) {
    if (injected(op, path, name, tries, off, len)) continue;
    const int64_t r = call();
    if (!(r < 0 && errno == EINTR && ++tries < kMaxRetries)) return r;
  }
}
}  // namespace

int open(const std::string& path, int flags, mode_t mode, const std::string* shown) {
  const std::string& name = shown ? *shown : path;
  const int64_t fd = retrying(Op::Open, name, "open", [&] { return ::open(path.c_str(), flags | O_CLOEXEC, mode); });
  return static_cast<int>(check_sys(fd, "open", name));
}

void close_quiet(int fd) noexcept {
  if (fd >= 0) ::close(fd);
}

void unlink_quiet(const std::string& path) noexcept { ::unlink(path.c_str()); }

int64_t pwrite_raw(int fd, const void* buf, uint64_t len, int64_t off) noexcept {
  ssize_t r = ::pwrite(fd, buf, len, off);
  return r < 0 ? -errno : r;
}

int64_t pread_raw(int fd, void* buf, uint64_t len, int64_t off) noexcept {
  ssize_t r = ::pread(fd, buf, len, off);
  return r < 0 ? -errno : r;
}

int64_t preadv_raw(int fd, const struct iovec* iov, int iovcnt, int64_t off) noexcept {
  ssize_t r = ::preadv(fd, iov, iovcnt, off);
  return r < 0 ? -errno : r;
}

namespace {

// The one loop of a whole synchronous transfer (pwrite_full, pread_full): the
// fault hook before each call, EINTR/EAGAIN retried, short transfers
// continued. A transfer of 0 bytes is end of file for a read (`eof_ends`) and
// EIO for a write; an injected one (short = 0) is retried.
template <class Raw>
uint64_t transfer_full(Op op, const char* name, Raw raw, uint64_t len, int64_t off, const std::string& path,
                       bool eof_ends) {
  uint64_t done = 0;
  int tries = 0;
  while (done < len) {
    uint64_t want = len - done;
    fault::Action a = fault::on(op, path);
    if (a.err && !(retryable(a.err) && ++tries < kMaxRetries)) throw_io(a.err, name, path, off + done, want);
    if (a.err) continue;
    if (a.short_len >= 0 && static_cast<uint64_t>(a.short_len) < want) want = a.short_len;
    int64_t r = want ? raw(done, want, off + static_cast<int64_t>(done)) : 0;
    if ((r == -EINTR || r == -EAGAIN) && ++tries < kMaxRetries) continue;
    if (r < 0) throw_io(static_cast<int>(-r), name, path, off + done, len - done);
    if (r == 0) {
      if (a.short_len == 0) continue;  // injected zero-length transfer: retry
      if (eof_ends) break;             // end of file
      throw_io(EIO, name, path, off + done, len - done);
    }
    done += static_cast<uint64_t>(r);
  }
  return done;
}

}  // namespace

void pwrite_full(int fd, const void* buf, uint64_t len, int64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(buf);
  transfer_full(
      Op::Write, "pwrite", [&](uint64_t done, uint64_t n, int64_t at) { return pwrite_raw(fd, p + done, n, at); },
      len, off, path, /*eof_ends=*/false);
}

uint64_t pread_full(int fd, void* buf, uint64_t len, int64_t off, const std::string& path) {
  char* p = static_cast<char*>(buf);
  return transfer_full(
      Op::Read, "pread", [&](uint64_t done, uint64_t n, int64_t at) { return pread_raw(fd, p + done, n, at); }, len,
      off, path, /*eof_ends=*/true);
}

int64_t cached_pages_raw(int fd, uint64_t off, uint64_t len, const std::string& path) noexcept {
#ifndef __NR_cachestat
#define __NR_cachestat 451  // the same number on every architecture (the generic table)
#endif
  struct {
    uint64_t off, len;
  } range = {off, len};
  struct {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
  } cs = {};
  if (len == 0) return 0;  // cachestat's len 0 means "to the end of the file"
  const fault::Action c = fault::on(Op::CacheQuery, path);
  if (c.err) return -c.err;
  long r;
  do {
    r = ::syscall(__NR_cachestat, fd, &range, &cs, 0);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return -errno;
  if (c.short_len >= 0) cs.nr_cache = std::min<uint64_t>(cs.nr_cache, static_cast<uint64_t>(c.short_len) / 4096);
  return static_cast<int64_t>(cs.nr_cache);
}

int populate_write_raw(void* p, uint64_t len) noexcept {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  const uintptr_t page = 4096;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + len) & ~(page - 1);
  if (e <= a) return 0;
  int r;
  do {
    r = ::madvise(reinterpret_cast<void*>(a), e - a, MADV_POPULATE_WRITE);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : 0;
}

int advise_small_pages_raw(void* p, uint64_t len) noexcept {
  const uintptr_t page = 4096;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + len) & ~(page - 1);
  if (e <= a) return 0;
  return ::madvise(reinterpret_cast<void*>(a), e - a, MADV_NOHUGEPAGE) < 0 ? -errno : 0;
}

double thread_cpu_seconds() noexcept {
  struct timespec ts;
  if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int64_t pread_cached(int fd, void* buf, uint64_t len, int64_t off, const std::string& path) {
#ifdef RWF_NOWAIT
  char* p = static_cast<char*>(buf);
  uint64_t done = 0;
  int tries = 0;
  auto refused = [](int e) { return e == EOPNOTSUPP || e == EINVAL || e == ENOSYS; };
  while (done < len) {
    uint64_t want = len - done;
    bool last = false;  // the injected cache ends after this transfer
    fault::Action c = fault::on(Op::ReadCached, path);
    if (c.err == EAGAIN) break;
    if (refused(c.err)) return -1;
    if (c.err == EINTR && ++tries < kMaxRetries) continue;
    if (c.err) throw_io(c.err, "preadv2", path, off + done, want);
    if (c.short_len >= 0 && static_cast<uint64_t>(c.short_len) < want) {
      if (c.short_len == 0) break;
      want = c.short_len;
      last = true;
    }
    struct iovec iov = {p + done, want};
    ssize_t r = ::preadv2(fd, &iov, 1, off + static_cast<int64_t>(done), RWF_NOWAIT);
    if (r < 0) {
      const int e = errno;
      if (e == EINTR && ++tries < kMaxRetries) continue;
      if (e == EAGAIN) break;  // the next byte is not in the page cache
      if (refused(e)) return done ? static_cast<int64_t>(done) : -1;
      throw_io(e, "preadv2", path, off + done, want);
    }
    if (r == 0) break;  // end of file
    // Data came back: now it counts as a read of file data (Op::Read), as
    // from the disk; a miss above did not.
    fault::Action a = fault::on(Op::Read, path);
    if (a.err && !(retryable(a.err) && ++tries < kMaxRetries)) throw_io(a.err, "pread", path, off + done, want);
    if (a.err) continue;
    bool again = false;  // an injected short transfer: ask for the rest
    if (a.short_len >= 0 && a.short_len < r) {
      r = a.short_len;
      again = true;
    }
    done += static_cast<uint64_t>(r);
    // Short: the next page is not cached (asking again would only return EAGAIN).
    if (last || (static_cast<uint64_t>(r) < want && !again)) break;
  }
  return static_cast<int64_t>(done);
#else
  (void)fd, (void)buf, (void)len, (void)off, (void)path;
  return -1;
#endif
}

namespace {
// TEST ONLY (docs/ENGINE.md, tests/powerloss/): FASTCKPT_TEST_SKIP_SYNC=data|dir|all turns the
// data fdatasync, the directory fsync or both into no-ops, read at each call, so that the
// power-loss tests can prove that they notice a missing sync. Never set it for real data.
bool test_skip_sync(const char* what) noexcept {
  const char* v = std::getenv("FASTCKPT_TEST_SKIP_SYNC");
  return v && (std::strcmp(v, "all") == 0 || std::strcmp(v, what) == 0);
}
}  // namespace

void fdatasync(int fd, const std::string& path) {
  if (test_skip_sync("data")) return;
  check_sys(retrying(Op::Fsync, path, "fdatasync", [&] { return ::fdatasync(fd); }), "fdatasync", path);
}

int fdatasync_raw(int fd) noexcept {
  if (test_skip_sync("data")) return 0;
  int r;
  do {
    r = ::fdatasync(fd);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : 0;
}

void fsync_dir(const std::string& dir) {
  if (test_skip_sync("dir")) return;
  int tries = 0;
  while (injected(Op::Fsync, dir, "fsync", tries)) {
  }
  int fd = sys::open(dir, O_RDONLY | O_DIRECTORY);
  int r;
  do {
    r = ::fsync(fd);
  } while (r < 0 && errno == EINTR && ++tries < kMaxRetries);
  int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on directories (EINVAL); the rename is
  // then as durable as that filesystem can make it.
  if (r < 0 && err != EINVAL) throw_io(err, "fsync", dir);
}

void rename(const std::string& from, const std::string& to) {
  const std::string both = from + " -> " + to;
  int tries = 0;
  while (injected(Op::Rename, to, "rename", tries, -1, 0, &both)) {
  }
  check_sys(::rename(from.c_str(), to.c_str()), "rename", both);
}

bool rename_exchange(const std::string& a, const std::string& b) {
#ifndef RENAME_EXCHANGE
  constexpr unsigned kExchange = 1u << 1;  // linux/fs.h, absent from older C libraries' headers
#else
  constexpr unsigned kExchange = RENAME_EXCHANGE;
#endif
  const std::string both = a + " <-> " + b;
  auto refused = [](int err) { return err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == ENOTSUP; };
  // Test-only: FASTCKPT_TEST_NO_EXCHANGE=1 makes every exchange "not offered", as on a filesystem
  // without it, so that the tests (crash driver, power loss) exercise the callers' fallback.
  const char* off = std::getenv("FASTCKPT_TEST_NO_EXCHANGE");
  if (off && std::strcmp(off, "1") == 0) return false;
  int tries = 0;
  for (;;) {
    fault::Action f = fault::on(Op::Rename, b);
    if (f.err) {
      if (refused(f.err)) return false;
      if (retryable(f.err) && ++tries < kMaxRetries) continue;
      throw_io(f.err, "renameat2(RENAME_EXCHANGE)", both);
    }
#ifdef SYS_renameat2
    const long r = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kExchange);
#else
    const long r = -1;
    errno = ENOSYS;
#endif
    if (r == 0) return true;
    const int err = errno;
    if (err == EINTR && ++tries < kMaxRetries) continue;
    if (refused(err)) return false;
    throw_io(err, "renameat2(RENAME_EXCHANGE)", both);
  }
}

bool fallocate(int fd, uint64_t len, const std::string& path) {
  if (len == 0) return true;
  const int64_t r = retrying(
      Op::Fallocate, path, "fallocate", [&] { return ::fallocate(fd, 0, 0, static_cast<off_t>(len)); }, 0, len);
  if (r < 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) return false;
  check_sys(r, "fallocate", path, 0, len);
  return true;
}

void ftruncate(int fd, uint64_t len, const std::string& path) {
  const int64_t r = retrying(
      Op::Truncate, path, "ftruncate", [&] { return ::ftruncate(fd, static_cast<off_t>(len)); },
      static_cast<int64_t>(len));
  check_sys(r, "ftruncate", path, static_cast<int64_t>(len));
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st;
  check_sys(::fstat(fd, &st), "fstat", path);
  return static_cast<uint64_t>(st.st_size);
}

bool try_lock_exclusive(int fd) noexcept {
  int r;
  do {
    r = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (r < 0 && errno == EINTR);
  return r == 0;
}

void set_direct(int fd, bool on, const std::string& path) {
  int fl = static_cast<int>(check_sys(::fcntl(fd, F_GETFL), "fcntl(F_GETFL)", path));
  fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
  check_sys(::fcntl(fd, F_SETFL, fl), "fcntl(F_SETFL)", path);
}

static uint32_t blockdev_logical_block_size(dev_t dev) {
  char p[128];
  // A partition has no queue/ of its own: try the device, then its parent.
  const char* fmts[] = {"/sys/dev/block/%u:%u/queue/logical_block_size",
                        "/sys/dev/block/%u:%u/../queue/logical_block_size"};
  for (const char* f : fmts) {
    std::snprintf(p, sizeof p, f, major(dev), minor(dev));
    std::ifstream in(p);
    uint32_t v = 0;
    if (in >> v && v >= 512 && (v & (v - 1)) == 0) return v;
  }
  return 0;
}

DioAlign dio_alignment(int fd, const std::string& path) {
  DioAlign out;
  struct statx stx {};
  long r = ::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx);
  if (r == 0 && (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align > 0) {
    out.mem = stx.stx_dio_mem_align;
    out.offset = stx.stx_dio_offset_align;
    out.source = "statx";
    return out;
  }
  struct stat st;
  check_sys(::fstat(fd, &st), "fstat", path);
  if (uint32_t b = blockdev_logical_block_size(st.st_dev)) {
    out.mem = b;
    out.offset = b;
    out.source = "blockdev";
  }
  return out;
}

std::string dirname(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string basename(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace sys
}  // namespace fastckpt
