// Thin wrappers over the system calls the engine makes. Each one consults the
// fault-injection hook, retries EINTR, and reports failure through the one
// checker (check_sys / throw_io), except the *_raw calls used by I/O backends,
// which return -errno so that completions can be handled uniformly.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>

namespace fastckpt {
namespace sys {

// open(2); throws IoError. `shown`, if given, is the name the fault hook and
// error messages use instead of `path` (e.g. for a /proc/self/fd reopen).
int open(const std::string& path, int flags, mode_t mode = 0644, const std::string* shown = nullptr);
// close(2), errors ignored (data was already made durable by fdatasync).
void close_quiet(int fd) noexcept;
// unlink(2), errors ignored (cleanup paths).
void unlink_quiet(const std::string& path) noexcept;

// One pwrite/pread (no loop): bytes transferred, or -errno.
int64_t pwrite_raw(int fd, const void* buf, uint64_t len, int64_t off) noexcept;
int64_t pread_raw(int fd, void* buf, uint64_t len, int64_t off) noexcept;
// One preadv (no loop) into iovcnt segments: bytes transferred, or -errno.
int64_t preadv_raw(int fd, const struct iovec* iov, int iovcnt, int64_t off) noexcept;
// Loops until everything is transferred; throws IoError. pread_full returns
// the number of bytes read, which is less than len only at end of file.
void pwrite_full(int fd, const void* buf, uint64_t len, int64_t off, const std::string& path);
uint64_t pread_full(int fd, void* buf, uint64_t len, int64_t off, const std::string& path);
// Reads [off, off+len) from the page cache only: preadv2(RWF_NOWAIT) on a
// buffered descriptor, which never waits for the disk. Returns the number of
// bytes read, from `off` on, before the first byte that is not cached (or end
// of file): 0 .. len. Returns -1 when the kernel or the filesystem refuses
// RWF_NOWAIT (EOPNOTSUPP, EINVAL, ENOSYS): the caller reads normally. EAGAIN
// is not an error (not cached); any other failure throws IoError. Fault hook:
// Op::ReadCached, then Op::Read (fault.h).
int64_t pread_cached(int fd, void* buf, uint64_t len, int64_t off, const std::string& path);

void fdatasync(int fd, const std::string& path);
// fdatasync without throwing: 0 or -errno (used by the thread backend).
int fdatasync_raw(int fd) noexcept;
// Opens `dir` and fsyncs it, making a rename or creation in it durable.
void fsync_dir(const std::string& dir);
void rename(const std::string& from, const std::string& to);
// renameat2(a, b, RENAME_EXCHANGE): swaps two existing paths (two directories
// of a directory commit) in one atomic step, so that `b` names a complete copy
// at every instant. Returns false when the kernel or the filesystem does not
// offer the exchange (EINVAL, ENOSYS, EOPNOTSUPP: e.g. some FUSE and NFS
// mounts, kernels before 3.15): the caller then uses its fallback. Any other
// failure throws IoError naming both paths. Fault hook: Op::Rename on `b` (an
// injected EINVAL or ENOSYS reads as "not offered", as the real refusal does; the test-only
// FASTCKPT_TEST_NO_EXCHANGE=1 makes every exchange "not offered").
bool rename_exchange(const std::string& a, const std::string& b);
// Preallocates [0, len). Returns false when the filesystem does not support it.
bool fallocate(int fd, uint64_t len, const std::string& path);
void ftruncate(int fd, uint64_t len, const std::string& path);
uint64_t file_size(int fd, const std::string& path);
// flock(LOCK_EX|LOCK_NB), errors ignored: whether the lock was taken.
bool try_lock_exclusive(int fd) noexcept;
// How many pages of [off, off+len) of the file open as `fd` (at `path`) the
// page cache holds (cachestat(2), Linux 6.5+), without reading anything;
// -errno when the kernel cannot say (ENOSYS before 6.5). Advisory: the count
// can be low (RangeReader::cached_pages says when and what it does about it).
int64_t cached_pages_raw(int fd, uint64_t off, uint64_t len, const std::string& path) noexcept;
// Faults in [p, p+len) for writing (madvise MADV_POPULATE_WRITE on the whole
// pages inside it): memory that a read will fill, so that the read does not
// fault it in page by page. Advisory: 0 or -errno (EINVAL on kernels before
// 5.14); a real problem with the memory surfaces in the read itself.
int populate_write_raw(void* p, uint64_t len) noexcept;
// Advises [p, p+len) (the whole pages inside it) small pages from now on
// (madvise MADV_NOHUGEPAGE): pages already faulted in stay as they are.
// Advisory: 0 or -errno.
int advise_small_pages_raw(void* p, uint64_t len) noexcept;
// CPU time of the calling thread, in seconds (CLOCK_THREAD_CPUTIME_ID; 0 if
// the clock is refused).
double thread_cpu_seconds() noexcept;
// Clears or sets O_DIRECT on an open descriptor.
void set_direct(int fd, bool on, const std::string& path);

// Direct-I/O alignment of an open file: statx(STATX_DIOALIGN), else the block
// device's logical block size, else 4096.
struct DioAlign {
  uint32_t mem = 4096;
  uint32_t offset = 4096;
  const char* source = "default";  // "statx", "blockdev" or "default"
};
DioAlign dio_alignment(int fd, const std::string& path);

std::string dirname(const std::string& path);
std::string basename(const std::string& path);

}  // namespace sys
}  // namespace fastckpt
