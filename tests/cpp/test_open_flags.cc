// Temporary files are created with O_CREAT|O_EXCL|O_NOFOLLOW on every path
// (O_DIRECT or buffered, and after O_DIRECT is refused at open), so that a
// file or symlink planted under the temporary name is never opened, followed
// or truncated.
//
// This program interposes open(2): the engine's calls reach the wrapper below,
// which records the flags of every open of a temporary file and can play the
// attacker, planting a symlink to a victim file under the name being created.
// (Its own TU must not see glibc's fortified inline open.)
#undef _FORTIFY_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>

#include "util.h"

namespace {

struct Spy {
  std::mutex mu;
  std::vector<int> temp_flags;        // flags of every open of a temporary file
  std::string victim;                 // plant a symlink to this file ...
  bool plant_before_create = false;   // ... under the name, before the engine's open
  bool create_then_einval = false;    // O_DIRECT open: create the file, swap in the symlink, fail EINVAL
};

Spy& spy() {
  static Spy s;
  return s;
}

int real_open(const char* path, int flags, mode_t mode) {
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags, mode));
}

int spy_open(const char* path, int flags, mode_t mode) {
  Spy& s = spy();
  if (std::strstr(path, ".fastckpt-tmp.") && (flags & O_CREAT)) {
    bool plant = false, einval = false;
    std::string victim;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.temp_flags.push_back(flags);
      victim = s.victim;
      if (s.plant_before_create) {
        plant = true;
        s.plant_before_create = false;
      }
      if (s.create_then_einval && (flags & O_DIRECT)) {
        einval = true;
        s.create_then_einval = false;
      }
    }
    if (plant) (void)::symlink(victim.c_str(), path);
    if (einval) {
      int fd = real_open(path, (flags & ~O_DIRECT), mode);
      if (fd >= 0) ::close(fd);
      ::unlink(path);
      (void)::symlink(victim.c_str(), path);  // the attacker wins the race
      errno = EINVAL;
      return -1;
    }
  }
  int r = real_open(path, flags, mode);
  return r;
}

}  // namespace

extern "C" int open(const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, int));
    va_end(ap);
  }
  return spy_open(path, flags, mode);
}

extern "C" int open64(const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, int));
    va_end(ap);
  }
  return spy_open(path, flags, mode);
}

using namespace fct;

namespace {
void reset_spy(const std::string& victim) {
  std::lock_guard<std::mutex> lk(spy().mu);
  spy().temp_flags.clear();
  spy().victim = victim;
  spy().plant_before_create = false;
  spy().create_then_einval = false;
}

void check_all_exclusive(const char* file, int line) {
  std::lock_guard<std::mutex> lk(spy().mu);
  if (spy().temp_flags.empty()) fail(file, line, "the spy saw no open of a temporary file (interposition failed?)");
  for (int f : spy().temp_flags) {
    if (!(f & O_EXCL) || !(f & O_NOFOLLOW) || !(f & O_CREAT) || (f & O_TRUNC))
      fail(file, line, "a temporary file was opened with flags 0" + std::to_string(f) +
                           " (needs O_CREAT|O_EXCL|O_NOFOLLOW, no O_TRUNC)");
  }
}
#define CHECK_ALL_EXCLUSIVE() check_all_exclusive(__FILE__, __LINE__)
}  // namespace

TEST(temporary_files_are_created_exclusively, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  reset_spy("");
  const std::string data = random_bytes(200000, 1);
  save(eng, dir.file("a.bin"), data);
  CHECK_ALL_EXCLUSIVE();
  CHECK_BYTES(read_file(dir.file("a.bin")), data);
}

TEST(a_symlink_planted_under_the_temporary_name_is_never_followed, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string victim = dir.file("victim.txt");
  write_file_plain(victim, "precious");
  reset_spy(victim);
  spy().plant_before_create = true;
  const std::string data = random_bytes(200000, 2);
  save(eng, dir.file("a.bin"), data);  // takes another name and succeeds
  CHECK_EQ(read_file(victim), std::string("precious"));
  CHECK_BYTES(read_file(dir.file("a.bin")), data);
  CHECK_ALL_EXCLUSIVE();
  CHECK(spy().temp_flags.size() >= 2);
}

TEST(after_o_direct_is_refused_at_open_the_reopen_is_exclusive_too, DIRECT) {
  EngineConfig cfg = direct_config();
  TempDir dir;
  Engine eng(cfg);
  const std::string victim = dir.file("victim.txt");
  write_file_plain(victim, "precious");
  reset_spy(victim);
  spy().create_then_einval = true;
  const std::string data = random_bytes(200000, 3);
  WriteStats st = save(eng, dir.file("a.bin"), data);
  CHECK(!st.direct);
  CHECK_CONTAINS(st.fallback, "open(O_DIRECT)");
  CHECK_EQ(read_file(victim), std::string("precious"));
  CHECK_BYTES(read_file(dir.file("a.bin")), data);
  CHECK_ALL_EXCLUSIVE();
  CHECK_NO_TEMP_FILES(dir.path());
}

FCT_MAIN()
