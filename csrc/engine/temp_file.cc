#include "temp_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "error.h"
#include "sys.h"

namespace fastckpt {

namespace {

constexpr const char* kMark = ".fastckpt-tmp.";
constexpr size_t kMaxHost = 40;

// At most 19 digits: always below 2^64, so std::stoull never throws.
bool all_digits(const std::string& s) {
  if (s.empty() || s.size() > 19) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

bool all_hex(const std::string& s) {
  if (s.empty() || s.size() > 16) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool host_token_ok(const std::string& s) {
  if (s.empty() || s.size() > kMaxHost) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || c == '_' ||
          c == '~'))
      return false;
  return true;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  size_t i = 0;
  for (;;) {
    size_t j = s.find('.', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) return out;
    i = j + 1;
  }
}

}  // namespace

std::string escape_host(const std::string& host) {
  std::string out;
  for (unsigned char c : host) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      char b[4];
      std::snprintf(b, sizeof b, "_%02x", c);
      out += b;
    }
  }
  if (out.empty()) out = "_";
  if (out.size() > kMaxHost) {
    char h[24];
    std::snprintf(h, sizeof h, "~%016llx", static_cast<unsigned long long>(fnv1a(host)));
    out = out.substr(0, 24) + h;
  }
  return out;
}

const std::string& temp_host_token() {
  static const std::string token = [] {
    char buf[HOST_NAME_MAX + 1] = {0};
    if (::gethostname(buf, sizeof buf - 1) != 0) buf[0] = '\0';
    return escape_host(buf);
  }();
  return token;
}

uint64_t process_start_time(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line)) return 0;
  size_t rp = line.rfind(')');  // the command name may hold spaces and ')'
  if (rp == std::string::npos) return 0;
  std::istringstream fields(line.substr(rp + 1));
  std::string f;
  // Fields after the name start at field 3 (state); starttime is field 22.
  for (int i = 3; i <= 22; ++i)
    if (!(fields >> f)) return 0;
  return all_digits(f) ? std::stoull(f) : 0;
}

std::string temp_key(const std::string& name) {
  static const char* digits = "0123456789abcdef";
  if (name.size() > kMaxHexName) {
    char h[24];
    std::snprintf(h, sizeof h, "h%016llx", static_cast<unsigned long long>(fnv1a(name)));
    return h;
  }
  std::string out = "x";
  for (unsigned char c : name) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string temp_path_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  // Read each time (one small file per save): correct in a forked child too.
  const int pid = static_cast<int>(::getpid());
  const uint64_t start = process_start_time(pid);
  const uint64_t n = counter.fetch_add(1);
  const uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string dir = sys::dirname(path);
  const std::string name = sys::basename(path);
  char suffix[96];
  std::snprintf(suffix, sizeof suffix, "%d.%s.%llu.%llu.%llx", pid, temp_host_token().c_str(),
                static_cast<unsigned long long>(start), static_cast<unsigned long long>(n),
                static_cast<unsigned long long>(t & 0xffffff));
  return (dir == "." && path.find('/') == std::string::npos ? std::string() : dir + "/") + kMark +
         temp_key(name) + "." + suffix;
}

namespace {

// The five fields after the key (or after the mark, in the earlier format).
bool parse_fields(const std::vector<std::string>& f, size_t at, TempNameInfo* out) {
  if (f.size() != at + 5 || !all_digits(f[at]) || !host_token_ok(f[at + 1]) || !all_digits(f[at + 2]) ||
      !all_digits(f[at + 3]) || !all_hex(f[at + 4]))
    return false;
  unsigned long long pid = std::stoull(f[at]);
  if (pid == 0 || pid > INT_MAX) return false;
  out->pid = static_cast<int>(pid);
  out->host = f[at + 1];
  out->start = std::stoull(f[at + 2]);
  return true;
}

// The target's name from a key ("x" + hex; "h" + hash: empty), or false for no key.
bool decode_key(const std::string& key, std::string* name) {
  if (key.size() == 17 && key[0] == 'h') {
    name->clear();
    return all_hex(key.substr(1));
  }
  if (key.size() < 3 || key[0] != 'x' || key.size() % 2 != 1 || key.size() > 1 + 2 * kMaxHexName) return false;
  std::string out;
  for (size_t i = 1; i < key.size(); i += 2) {
    int v = 0;
    for (size_t j = i; j < i + 2; ++j) {
      const char c = key[j];
      if (c >= '0' && c <= '9') v = v * 16 + (c - '0');
      else if (c >= 'a' && c <= 'f') v = v * 16 + (c - 'a' + 10);
      else return false;
    }
    if (v == 0 || v == '/') return false;
    out.push_back(static_cast<char>(v));
  }
  if (out == "." || out == "..") return false;
  *name = out;
  return true;
}

}  // namespace

bool parse_temp_entry(const std::string& entry, TempNameInfo* out) {
  const std::string mark = kMark;
  TempNameInfo info;
  if (entry.compare(0, mark.size(), mark) == 0) {
    std::vector<std::string> f = split_dots(entry.substr(mark.size()));
    if (f.size() != 6 || !decode_key(f[0], &info.target) || !parse_fields(f, 1, &info)) return false;
    info.key = f[0];
  } else {
    // The earlier format: ".NAME" + mark + the five fields (NAME may itself hold dots).
    const size_t at = entry.rfind(mark);
    if (at == std::string::npos || at < 2 || entry[0] != '.') return false;
    if (!parse_fields(split_dots(entry.substr(at + mark.size())), 0, &info)) return false;
    info.target = entry.substr(1, at - 1);
    info.key = temp_key(info.target);
  }
  *out = info;
  return true;
}

bool parse_temp_name(const std::string& entry, const std::string& target_name, TempNameInfo* out) {
  TempNameInfo info;
  if (target_name.empty() || !parse_temp_entry(entry, &info) || info.key != temp_key(target_name)) return false;
  if (!info.target.empty() && info.target != target_name) return false;
  *out = info;
  return true;
}

bool temp_writer_gone(const TempNameInfo& info) {
  if (info.pid <= 0) return false;
  if (::kill(info.pid, 0) != 0) return errno == ESRCH;
  // A live process with this pid: the writer only if it started when the writer did.
  if (info.start == 0) return false;
  const uint64_t now = process_start_time(info.pid);
  return now != 0 && now != info.start;
}

// `name` empty: every temporary file in `dir`, whatever its target.
static void remove_leftovers_into(const std::string& dir, const std::string& name, std::vector<std::string>& removed);

int create_temp_file(const std::string& target, std::string* name, bool* direct, std::string* fallback) {
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW;
  int fd = -1;
  for (int attempt = 1;; ++attempt) {
    const std::string candidate = temp_path_for(target);
    try {
      if (*direct) {
        try {
          fd = sys::open(candidate, flags | O_DIRECT);
        } catch (const IoError& e) {
          if (e.err() != EINVAL) throw;
          // Some filesystems create the file, then refuse O_DIRECT: the name
          // was free a moment ago, so what is there now is that empty file.
          sys::unlink_quiet(candidate);
          *direct = false;
          *fallback = "open(O_DIRECT): EINVAL";
        }
      }
      if (fd < 0) fd = sys::open(candidate, flags);
    } catch (const IoError& e) {
      // The name is taken (planted, or left by an earlier process with this
      // pid): take another one.
      if (e.err() == EEXIST && attempt < 16) continue;
      throw;
    }
    *name = candidate;
    break;
  }
  sys::try_lock_exclusive(fd);
  return fd;
}

std::vector<std::string> remove_leftovers(const std::string& path) {
  std::vector<std::string> removed;
  const std::string name = sys::basename(path);
  if (name.empty()) return removed;
  try {
    remove_leftovers_into(sys::dirname(path), name, removed);
  } catch (...) {
    // Best effort (e.g. out of memory while listing): the save itself goes on.
  }
  return removed;
}

std::vector<std::string> remove_leftovers_in(const std::string& dir) {
  std::vector<std::string> removed;
  try {
    remove_leftovers_into(dir, std::string(), removed);
  } catch (...) {
  }
  return removed;
}

static void remove_leftovers_into(const std::string& dir, const std::string& name, std::vector<std::string>& removed) {
  const std::string key = name.empty() ? std::string() : temp_key(name);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  const int dfd = ::dirfd(d);
  const uid_t me = ::geteuid();
  std::vector<std::string> candidates;
  while (dirent* e = ::readdir(d)) {
    const char* n = e->d_name;
    if (!std::strstr(n, kMark)) continue;
    TempNameInfo info;
    if (!parse_temp_entry(n, &info)) continue;  // a directory's name (".dcp", ...) does not parse: never touched
    if (!name.empty() && (info.key != key || (!info.target.empty() && info.target != name))) continue;
    if (info.host != temp_host_token()) continue;  // another machine's: never ours to judge
    if (!temp_writer_gone(info)) continue;
    candidates.push_back(n);
  }
  for (const std::string& n : candidates) {
    struct stat st;
    if (::fstatat(dfd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != me) continue;
    // Write access: NFS emulates flock() with a write lock, which needs it.
    int fd = ::openat(dfd, n.c_str(), O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat fst;
    bool ok = ::fstat(fd, &fst) == 0 && fst.st_dev == st.st_dev && fst.st_ino == st.st_ino;
    if (ok && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      // Held: a live writer (perhaps in another pid namespace) has it. Any
      // other error (no lock support): the process check above decides.
      ok = errno != EWOULDBLOCK && errno != EAGAIN;
    }
    struct stat again;
    if (ok && ::fstatat(dfd, n.c_str(), &again, AT_SYMLINK_NOFOLLOW) == 0 && again.st_dev == st.st_dev &&
        again.st_ino == st.st_ino && ::unlinkat(dfd, n.c_str(), 0) == 0)
      removed.push_back(n);
    ::close(fd);
  }
  ::closedir(d);
}

}  // namespace fastckpt
