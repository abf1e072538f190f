// Engine-specific helpers for the C++ tests: temporary directories, the
// backend/direct variant chosen on the command line, data generation and
// comparison, and the checks made after every failure (descriptors, temporary
// files, staging buffers).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "config.h"
#include "crc32.h"
#include "engine.h"
#include "error.h"
#include "fault.h"
#include "harness.h"
#include "reader.h"
#include "sys.h"
#include "writer.h"

namespace fct {

using fastckpt::BackendKind;
using fastckpt::Engine;
using fastckpt::EngineConfig;
using fastckpt::IoError;
using fastckpt::ReadRange;
using fastckpt::ReadStats;
using fastckpt::TruncatedError;
using fastckpt::UsageError;
using fastckpt::Writer;
using fastckpt::WriteStats;
namespace fault = fastckpt::fault;

// ------------------------------------------------------------ files and dirs

inline int rm_rf_one(const char* p, const struct stat*, int, struct FTW*) {
  ::remove(p);
  return 0;
}

inline void rm_rf(const std::string& path) { ::nftw(path.c_str(), rm_rf_one, 16, FTW_DEPTH | FTW_PHYS); }

inline void mkdir_p(const std::string& path) {
  std::string cur;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    cur = path.substr(0, j);
    if (!cur.empty()) ::mkdir(cur.c_str(), 0755);
    i = j + 1;
  }
}

// FASTCKPT_TEST_DIR, or a mkdtemp under /tmp that is removed at exit.
inline const std::string& base_dir() {
  struct Base {
    std::string path;
    bool owned = false;
    Base() {
      const char* env = std::getenv("FASTCKPT_TEST_DIR");
      if (env && *env) {
        path = env;
        mkdir_p(path);
      } else {
        char tmpl[] = "/tmp/fastckpt-test.XXXXXX";
        if (!::mkdtemp(tmpl)) {
          std::perror("mkdtemp /tmp/fastckpt-test.XXXXXX");
          std::exit(1);
        }
        path = tmpl;
        owned = true;
      }
    }
    ~Base() {
      if (owned) rm_rf(path);
    }
  };
  static Base b;
  return b.path;
}

// A fresh directory for one test, removed with everything in it afterwards.
class TempDir {
 public:
  TempDir() {
    std::string t = base_dir() + "/t.XXXXXX";
    std::vector<char> buf(t.begin(), t.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) fail(__FILE__, __LINE__, std::string("mkdtemp: ") + std::strerror(errno));
    path_ = buf.data();
  }
  ~TempDir() { rm_rf(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

// Names of the engine's temporary files left in `dir`.
inline std::vector<std::string> temp_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& n : list_dir(dir))
    if (n.find(".fastckpt-tmp.") != std::string::npos) out.push_back(n);
  return out;
}

inline bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

inline int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// Open descriptors of this process (the directory stream's own is counted
// every time, so counts compare).
inline size_t count_fds() { return list_dir("/proc/self/fd").size(); }

// Plain read(2) of a whole file, independent of the engine.
inline std::string read_file(const std::string& path) {
  std::string out;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(__FILE__, __LINE__, "open " + path + ": " + std::strerror(errno));
  char buf[1 << 16];
  for (;;) {
    ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ::close(fd);
      fail(__FILE__, __LINE__, "read " + path + ": " + std::strerror(errno));
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

inline void write_file_plain(const std::string& path, const std::string& data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(__FILE__, __LINE__, "open " + path + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t r = ::write(fd, data.data() + done, data.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail(__FILE__, __LINE__, "write " + path + ": " + std::strerror(errno));
    done += static_cast<size_t>(r);
  }
  ::close(fd);
}

// Evicts a file's pages (or [off, off+len) of them) from the page cache, so
// that the engine's next read of them goes to the disk (read_ranges copies
// cached bytes first). Dirty pages are written back first.
inline void evict(const std::string& path, off_t off = 0, off_t len = 0) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(__FILE__, __LINE__, "open " + path + ": " + std::strerror(errno));
  ::fsync(fd);
  int r = ::posix_fadvise(fd, off, len, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (r != 0) fail(__FILE__, __LINE__, "posix_fadvise " + path + ": " + std::strerror(r));
}

// Holds every page of a file in the page cache while it lives: mapped
// (MAP_POPULATE reads in what is not cached) and locked. Unmapped page-cache
// pages can go at any moment, also in the middle of a read that a test
// expects to find them cached: the kernel's reclaim, another test's
// drop_caches, or the host's proactive reclaim (this VM runs a DAMON
// `pageout` scheme on unmapped file pages) take them. Skips the test where
// the file cannot be locked (RLIMIT_MEMLOCK without CAP_IPC_LOCK). `off`
// (a multiple of the page size) and `len` (0: to the end of the file): only
// those pages.
class CachePin {
 public:
  explicit CachePin(const std::string& path, off_t off = 0, size_t len = 0) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(__FILE__, __LINE__, "open " + path + ": " + std::strerror(errno));
    struct stat s;
    if (::fstat(fd, &s) != 0) fail(__FILE__, __LINE__, "fstat " + path + ": " + std::strerror(errno));
    len_ = len ? len : static_cast<size_t>(s.st_size > off ? s.st_size - off : 0);
    if (len_ > 0) {
      mem_ = ::mmap(nullptr, len_, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, off);
      const int e = errno;
      ::close(fd);
      if (mem_ == MAP_FAILED) fail(__FILE__, __LINE__, "mmap " + path + ": " + std::strerror(e));
      if (::mlock(mem_, len_) != 0) {
        const std::string why = std::strerror(errno);
        ::munmap(mem_, len_);
        mem_ = nullptr;
        SKIP("cannot keep " + path + " in the page cache (mlock: " + why + ")");
      }
    } else {
      ::close(fd);
    }
  }
  ~CachePin() {
    if (mem_) ::munmap(mem_, len_);  // unlocks too
  }
  CachePin(const CachePin&) = delete;
  CachePin& operator=(const CachePin&) = delete;

 private:
  void* mem_ = nullptr;
  size_t len_ = 0;
};

// ------------------------------------------------------------ data

inline std::string random_bytes(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(&s[i], &v, 8);
  }
  if (i < n) {
    uint64_t v = rng();
    std::memcpy(&s[i], &v, n - i);
  }
  return s;
}

// Compares two byte strings without printing megabytes: sizes, then the
// first differing offset.
inline void check_same_bytes(const std::string& got, const std::string& want, const char* what, const char* file,
                             int line) {
  if (got.size() != want.size())
    fail(file, line,
         std::string(what) + ": size " + std::to_string(got.size()) + " != expected " + std::to_string(want.size()));
  if (std::memcmp(got.data(), want.data(), got.size()) == 0) return;
  size_t i = 0;
  while (got[i] == want[i]) ++i;
  fail(file, line, std::string(what) + ": first difference at byte " + std::to_string(i) + " of " +
                       std::to_string(got.size()));
}
#define CHECK_BYTES(got, want) ::fct::check_same_bytes((got), (want), #got " vs " #want, __FILE__, __LINE__)

// ------------------------------------------------------------ variants

struct Variant {
  BackendKind backend = BackendKind::Threads;
  bool direct = true;
};

// --backend=uring|threads|auto (default threads), --buffered (direct=false).
inline Variant variant() {
  Variant v;
  std::string b = option("backend", "threads");
  v.backend = fastckpt::backend_kind_from_name(b);
  v.direct = option("buffered").empty();
  return v;
}

// Empty when io_uring works here; otherwise why not.
inline const std::string& uring_unavailable_reason() {
  static const std::string reason = []() -> std::string {
    if (!fastckpt::uring_compiled()) return "fastckpt was built without liburing";
    try {
      fastckpt::make_uring_backend(2, {});
      return "";
    } catch (const IoError& e) {
      return std::string("io_uring refused by this kernel/sandbox: ") + e.what();
    }
  }();
  return reason;
}

inline void require_uring() {
  if (!uring_unavailable_reason().empty()) SKIP(uring_unavailable_reason());
}

// Empty when the test directory's filesystem takes O_DIRECT; otherwise why not.
inline const std::string& direct_unavailable_reason() {
  static const std::string reason = []() -> std::string {
    std::string p = base_dir() + "/.odirect-probe";
    int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
    if (fd < 0) return "O_DIRECT open refused in " + base_dir() + ": " + std::strerror(errno);
    void* buf = nullptr;
    std::string why;
    if (::posix_memalign(&buf, 4096, 4096) != 0) why = "posix_memalign failed";
    if (why.empty()) {
      std::memset(buf, 0, 4096);
      if (::pwrite(fd, buf, 4096, 0) != 4096)
        why = "O_DIRECT write refused in " + base_dir() + ": " + std::strerror(errno);
    }
    std::free(buf);
    ::close(fd);
    ::unlink(p.c_str());
    return why;
  }();
  return reason;
}

// An engine configuration for the current variant, with small staging
// buffers so that tests exercise many of them cheaply. Skips (never passes)
// when the variant cannot run here.
inline EngineConfig config(size_t buffer_size = 64u << 10, size_t buffer_count = 4, unsigned queue_depth = 4) {
  Variant v = variant();
  if (v.backend == BackendKind::Uring) require_uring();
  if (v.direct && !direct_unavailable_reason().empty()) SKIP(direct_unavailable_reason());
  EngineConfig c;
  c.buffer_size = buffer_size;
  c.buffer_count = buffer_count;
  c.queue_depth = queue_depth;
  c.io_threads = 4;
  c.backend = v.backend;
  c.direct = v.direct;
  return c;
}

// For TEST(..., DIRECT): ctest runs them only in the O_DIRECT variants; run
// by hand with --buffered they do not apply.
inline EngineConfig direct_config() {
  if (!variant().direct) SKIP("an O_DIRECT test: does not apply with --buffered");
  return config();
}

inline const char* expected_backend_name() {
  return variant().backend == BackendKind::Uring ? "io_uring" : "threads";
}

// A short transfer the kernel could really produce: whole blocks under O_DIRECT.
inline int64_t short_unit() { return variant().direct ? 4096 : 1000; }

inline fault::Rule rule(fault::Op op, uint64_t nth, int err, uint64_t times = 1) {
  fault::Rule r;
  r.op = op;
  r.nth = nth;
  r.err = err;
  r.times = times;
  return r;
}

inline fault::Rule short_rule(fault::Op op, uint64_t nth, int64_t short_len, uint64_t times = 0) {
  fault::Rule r;
  r.op = op;
  r.nth = nth;
  r.short_len = short_len;
  r.times = times;
  return r;
}

// ------------------------------------------------------------ engine helpers

// Saves `data` to `path`: appended in `chunk`-byte pieces (0: at once).
inline WriteStats save(Engine& eng, const std::string& path, const std::string& data, size_t chunk = 0,
                       int64_t expected_size = -1) {
  Writer w(eng, path, expected_size);
  if (chunk == 0) chunk = data.size() ? data.size() : 1;
  for (size_t off = 0; off < data.size(); off += chunk)
    w.append(data.data() + off, std::min(chunk, data.size() - off));
  return w.commit();
}

// Reads the whole file through the engine (one range).
inline std::string load(Engine& eng, const std::string& path, size_t n, ReadStats* st = nullptr) {
  std::string out(n, '\x55');
  std::vector<ReadRange> rs;
  if (n) rs.push_back(ReadRange{&out[0], n, 0});
  ReadStats s = fastckpt::read_ranges(eng, path, rs);
  if (st) *st = s;
  return out;
}

// Checks made after a save or load: staging buffers back in the pool.
inline void check_pool_full(Engine& eng, const char* file, int line) {
  if (eng.pool().available() != eng.config().buffer_count)
    fail(file, line, "staging buffers not returned: " + std::to_string(eng.pool().available()) + " of " +
                         std::to_string(eng.config().buffer_count) + " available");
}
#define CHECK_POOL_FULL(eng) ::fct::check_pool_full((eng), __FILE__, __LINE__)

inline void check_no_temp_files(const std::string& dir, const char* file, int line) {
  std::vector<std::string> t = temp_files(dir);
  if (!t.empty()) fail(file, line, "temporary file left behind: " + dir + "/" + t[0]);
}
#define CHECK_NO_TEMP_FILES(dir) ::fct::check_no_temp_files((dir), __FILE__, __LINE__)

// Aligned memory for direct reads.
struct AlignedBuf {
  explicit AlignedBuf(size_t n, size_t align = 4096) : size(n) {
    size_t alloc = (n + align - 1) / align * align;
    if (alloc == 0) alloc = align;
    p = static_cast<char*>(std::aligned_alloc(align, alloc));
    if (!p) fail(__FILE__, __LINE__, "aligned_alloc failed");
    std::memset(p, 0x55, alloc);
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  std::string str(size_t off, size_t n) const { return std::string(p + off, n); }
  char* p;
  size_t size;
};

// n random bytes (seed) saved at `path` through `eng`, their pages evicted so
// that reads go to the disk path; returns the bytes.
inline std::string saved_cold(Engine& eng, const std::string& path, size_t n, uint64_t seed) {
  std::string data = random_bytes(n, seed);
  save(eng, path, data);
  evict(path);
  return data;
}

// Ranges packed back to back at unaligned offsets, as a safetensors file's
// tensors are, each read into memory of its own that starts at its offset's
// phase within a page (fastckpt's host_storage), with guard bytes around it:
// their aligned bodies are read straight in, the blocks between them staged,
// and runs of them that follow each other in the file are read by one
// vectored request (reader.cc, group_jobs). Or ranges at given offsets, as
// records between headers are.
struct PackedRanges {
  static constexpr size_t kGuard = 64;
  PackedRanges(size_t first_off, const std::vector<size_t>& lens) : PackedRanges(packed(first_off, lens), lens) {}
  // Ranges of `lens` bytes at offsets `at` (in file order), each in memory of its own at its phase.
  PackedRanges(const std::vector<size_t>& at, const std::vector<size_t>& lens) : offs(at), crcs(lens.size(), 0) {
    for (size_t i = 0; i < lens.size(); ++i) {
      bufs.emplace_back(new AlignedBuf(offs[i] % 4096 + lens[i] + kGuard + 4096));  // filled with 0x55
      ranges.push_back(ReadRange{bufs[i]->p + offs[i] % 4096, lens[i], offs[i], &crcs[i]});
    }
    end = lens.empty() ? 0 : offs.back() + lens.back();
  }
  static std::vector<size_t> packed(size_t off, const std::vector<size_t>& lens) {
    std::vector<size_t> at;
    for (size_t len : lens) {
      at.push_back(off);
      off += len;
    }
    return at;
  }
  // Every range's bytes and CRC as in `data`, nothing written around them.
  void check(const std::string& data, const char* file, int line) const {
    for (size_t i = 0; i < ranges.size(); ++i) {
      const size_t phase = offs[i] % 4096, len = ranges[i].len;
      const std::string where = " (range " + std::to_string(i) + ")";
      if (bufs[i]->str(phase, len) != data.substr(offs[i], len)) fail(file, line, "bytes differ" + where);
      if (crcs[i] != fastckpt::crc32(0, data.data() + offs[i], len)) fail(file, line, "CRC differs" + where);
      if (bufs[i]->str(0, phase) != std::string(phase, '\x55') ||
          bufs[i]->str(phase + len, kGuard) != std::string(kGuard, '\x55'))
        fail(file, line, "written outside its memory" + where);
    }
  }
  std::vector<std::unique_ptr<AlignedBuf>> bufs;
  std::vector<size_t> offs;
  std::vector<uint32_t> crcs;
  std::vector<ReadRange> ranges;
  size_t end = 0;
};
#define CHECK_PACKED(packed, data) (packed).check((data), __FILE__, __LINE__)

// Every test starts and ends with no fault armed.
inline bool install_fault_hooks() {
  state().before_each.push_back([] { fault::clear(); });
  state().after_each.push_back([] { fault::clear(); });
  return true;
}
static const bool fct_fault_hooks_installed = install_fault_hooks();

}  // namespace fct
