#include "sys.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "error.h"
#include "fault.h"

namespace fastckpt {
namespace sys {

using fault::Op;

int open(const std::string& path, int flags, mode_t mode) {
  fault::Action a = fault::on(Op::Open, path);
  if (a.err) throw_io(a.err, "open", path);
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return static_cast<int>(check_sys(fd, "open", path));
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

void pwrite_full(int fd, const void* buf, uint64_t len, int64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(buf);
  uint64_t done = 0;
  while (done < len) {
    uint64_t want = len - done;
    fault::Action a = fault::on(Op::Write, path);
    if (a.err) throw_io(a.err, "pwrite", path, off + done, want);
    if (a.short_len >= 0 && static_cast<uint64_t>(a.short_len) < want) want = a.short_len;
    int64_t r = want ? pwrite_raw(fd, p + done, want, off + done) : 0;
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) throw_io(static_cast<int>(-r), "pwrite", path, off + done, len - done);
    if (r == 0 && a.short_len != 0) throw_io(EIO, "pwrite", path, off + done, len - done);
    done += r;
  }
}

uint64_t pread_full(int fd, void* buf, uint64_t len, int64_t off, const std::string& path) {
  char* p = static_cast<char*>(buf);
  uint64_t done = 0;
  while (done < len) {
    uint64_t want = len - done;
    fault::Action a = fault::on(Op::Read, path);
    if (a.err) throw_io(a.err, "pread", path, off + done, want);
    if (a.short_len >= 0 && static_cast<uint64_t>(a.short_len) < want) want = a.short_len;
    int64_t r = want ? pread_raw(fd, p + done, want, off + done) : 0;
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) throw_io(static_cast<int>(-r), "pread", path, off + done, len - done);
    if (r == 0) {
      if (a.short_len == 0) continue;  // injected zero-length transfer: retry
      break;                           // end of file
    }
    done += r;
  }
  return done;
}

void fdatasync(int fd, const std::string& path) {
  fault::Action a = fault::on(Op::Fsync, path);
  if (a.err) throw_io(a.err, "fdatasync", path);
  int r;
  do {
    r = ::fdatasync(fd);
  } while (r < 0 && errno == EINTR);
  check_sys(r, "fdatasync", path);
}

int fdatasync_raw(int fd) noexcept {
  int r;
  do {
    r = ::fdatasync(fd);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : 0;
}

void fsync_dir(const std::string& dir) {
  fault::Action a = fault::on(Op::Fsync, dir);
  if (a.err) throw_io(a.err, "fsync", dir);
  int fd = sys::open(dir, O_RDONLY | O_DIRECTORY);
  int r;
  do {
    r = ::fsync(fd);
  } while (r < 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on directories (EINVAL); the rename is
  // then as durable as that filesystem can make it.
  if (r < 0 && err != EINVAL) throw_io(err, "fsync", dir);
}

void rename(const std::string& from, const std::string& to) {
  fault::Action a = fault::on(Op::Rename, to);
  if (a.err) throw_io(a.err, "rename", from + " -> " + to);
  check_sys(::rename(from.c_str(), to.c_str()), "rename", from + " -> " + to);
}

bool fallocate(int fd, uint64_t len, const std::string& path) {
  if (len == 0) return true;
  fault::Action a = fault::on(Op::Fallocate, path);
  if (a.err) throw_io(a.err, "fallocate", path, 0, len);
  int r;
  do {
    r = ::fallocate(fd, 0, 0, static_cast<off_t>(len));
  } while (r < 0 && errno == EINTR);
  if (r < 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) return false;
  check_sys(r, "fallocate", path, 0, len);
  return true;
}

void ftruncate(int fd, uint64_t len, const std::string& path) {
  fault::Action a = fault::on(Op::Truncate, path);
  if (a.err) throw_io(a.err, "ftruncate", path, static_cast<int64_t>(len));
  int r;
  do {
    r = ::ftruncate(fd, static_cast<off_t>(len));
  } while (r < 0 && errno == EINTR);
  check_sys(r, "ftruncate", path, static_cast<int64_t>(len));
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st;
  check_sys(::fstat(fd, &st), "fstat", path);
  return static_cast<uint64_t>(st.st_size);
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
