// Hardening of the engine: leftovers of crashed saves, fork(),
// io_uring submit/wait failures, size knobs that overflow, errors naming the
// user's file.
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <memory>

#include "temp_file.h"
#include "util.h"

using namespace fct;
using fault::Op;

namespace {

EngineConfig small(BackendKind backend, size_t count = 4, unsigned depth = 4) {
  EngineConfig c;
  c.buffer_size = 64u << 10;
  c.buffer_count = count;
  c.queue_depth = depth;
  c.io_threads = 2;
  c.backend = backend;
  c.direct = direct_unavailable_reason().empty();
  return c;
}

// Forks a child that starts a save of `path` and dies without committing or
// cleaning up (_exit skips every destructor, as SIGKILL would); returns the
// temporary file it left.
std::string crashed_save(const std::string& path) {
  int pfd[2];
  if (::pipe(pfd) != 0) fail(__FILE__, __LINE__, "pipe");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pfd[0]);
    EngineConfig c = small(BackendKind::Threads);
    Engine* eng = new Engine(c);
    Writer* w = new Writer(*eng, path, -1);
    std::string d = random_bytes(100000, 3);
    w->append(d.data(), d.size());
    std::string t = w->tmp_path();
    (void)!::write(pfd[1], t.data(), t.size());
    ::_exit(0);
  }
  ::close(pfd[1]);
  char buf[4096];
  ssize_t n = ::read(pfd[0], buf, sizeof buf);
  ::close(pfd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (n <= 0) fail(__FILE__, __LINE__, "the crashing child reported no temporary file");
  return std::string(buf, static_cast<size_t>(n));
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string base(const std::string& p) { return p.substr(p.rfind('/') + 1); }

}  // namespace

// ------------------------------------------------------------ temporary names, leftovers

TEST(temp_names_carry_pid_host_and_start_time, ONCE) {
  CHECK_EQ(fastckpt::escape_host("node-1"), std::string("node-1"));
  CHECK_EQ(fastckpt::escape_host("a.b_c"), std::string("a_2eb_5fc"));
  const std::string longhost(100, 'x');
  CHECK(fastckpt::escape_host(longhost).size() <= 41);
  CHECK(fastckpt::escape_host(longhost) != fastckpt::escape_host(longhost + "y"));
  const std::string t = fastckpt::temp_path_for("/d/step.pt");
  CHECK_CONTAINS(t, "/d/.fastckpt-tmp." + fastckpt::temp_key("step.pt") + "." + std::to_string(::getpid()) + "." +
                        fastckpt::temp_host_token() + ".");
  CHECK(t.find("step") == std::string::npos);  // the target's name is not spelled out
  fastckpt::TempNameInfo info;
  CHECK(fastckpt::parse_temp_name(base(t), "step.pt", &info));
  CHECK_EQ(info.pid, static_cast<int>(::getpid()));
  CHECK_EQ(info.host, fastckpt::temp_host_token());
  CHECK_EQ(info.target, std::string("step.pt"));
  CHECK(info.start != 0);
  CHECK_EQ(info.start, fastckpt::process_start_time(::getpid()));
  CHECK(!fastckpt::temp_writer_gone(info));  // this process
  CHECK(!fastckpt::parse_temp_name(base(t), "step", &info));
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.3.4", "step.pt", &info));  // oldest format: no host
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.h.3.4.zz", "step.pt", &info));
  // Numbers too large for 64 bits are not names of ours (and never throw).
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.99999999999999999999.h.3.4.a", "step.pt", &info));
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.h.99999999999999999999.4.a", "step.pt", &info));
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.h.3.99999999999999999999.a", "step.pt", &info));
  // The earlier format, with the name spelled out, is still recognised (its leftovers are cleaned).
  CHECK(fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.h.3.4.a", "step.pt", &info));
  CHECK_EQ(info.target, std::string("step.pt"));
  CHECK_EQ(info.key, fastckpt::temp_key("step.pt"));
  CHECK(!fastckpt::parse_temp_name(".step.pt.fastckpt-tmp.12.h.3.4.a", "step", &info));
}

TEST(temp_name_keys_spell_no_checkpoint_name, ONCE) {
  // Names that frameworks find checkpoints by: none survives into a temporary's name.
  for (const char* n : {"hpc_ckpt_2.ckpt", "last.ckpt", "epoch=3-step=40.ckpt", "checkpoint-500", "step-10",
                        "global_step7", "model.safetensors"}) {
    const std::string t = base(fastckpt::temp_path_for(std::string("/d/") + n));
    const std::string key = fastckpt::temp_key(n);
    CHECK_EQ(key[0], 'x');
    for (char c : key.substr(1)) CHECK((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
    CHECK(t.compare(0, 14, ".fastckpt-tmp.") == 0);
    fastckpt::TempNameInfo info;
    CHECK(fastckpt::parse_temp_entry(t, &info));
    CHECK_EQ(info.target, std::string(n));
  }
  // Longer than kMaxHexName bytes: a hash; parsed, its target unknown, matched by its key.
  const std::string longname(fastckpt::kMaxHexName + 1, 'n');
  const std::string t = base(fastckpt::temp_path_for("/d/" + longname));
  CHECK(t.size() < 200);
  fastckpt::TempNameInfo info;
  CHECK(fastckpt::parse_temp_entry(t, &info));
  CHECK(info.target.empty());
  CHECK_EQ(info.key.size(), 17u);
  CHECK(fastckpt::parse_temp_name(t, longname, &info));
  CHECK(!fastckpt::parse_temp_name(t, longname + "x", &info));
  const std::string edge(fastckpt::kMaxHexName, 'e');  // the longest spelled out
  CHECK(fastckpt::parse_temp_entry(base(fastckpt::temp_path_for("/d/" + edge)), &info));
  CHECK_EQ(info.target, edge);
  // Keys that decode to no base name are not names of ours.
  const std::string tail = ".12." + fastckpt::temp_host_token() + ".3.4.a";
  for (const std::string& bad : {std::string("x2f"), std::string("x00"), std::string("x2e"), std::string("x2e2e"),
                                 std::string("x6"), std::string("xAB"), std::string("x"), std::string("h12"),
                                 std::string("y61")})
    CHECK(!fastckpt::parse_temp_entry(".fastckpt-tmp." + bad + tail, &info));
  CHECK(fastckpt::parse_temp_entry(".fastckpt-tmp.x61" + tail, &info));
  CHECK(!fastckpt::parse_temp_entry(".fastckpt-tmp.x61" + tail + ".dcp", &info));  // a directory's: not the engine's
}

TEST(next_save_removes_leftovers_of_dead_processes_of_this_host_only, ONCE) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  Engine eng(small(BackendKind::Threads));
  // A live writer of the same target, in this process: kept by every cleanup
  // below, and it commits at the end.
  std::unique_ptr<Writer> live(new Writer(eng, path, -1));
  live->append("live", 4);
  const std::string dead1 = crashed_save(path);
  CHECK(exists(dead1));
  // The next crashed save already removes the first one's leftover.
  const std::string dead2 = crashed_save(path);
  CHECK(!exists(dead1) && exists(dead2));
  const std::string other_target = crashed_save(dir.file("other.pt"));
  CHECK(exists(other_target));
  // Another host's file with a pid that does not exist here: never ours to judge.
  const std::string host_b = dir.file(".ckpt.pt.fastckpt-tmp.999999.other-host.5.0.1");
  write_file_plain(host_b, "x");
  // An older-format name (no host): kept.
  const std::string old_format = dir.file(".ckpt.pt.fastckpt-tmp.999999.0.1");
  write_file_plain(old_format, "x");
  // A reused pid: this process's pid with another start time -> the writer is gone.
  const std::string reused = dir.file(".ckpt.pt.fastckpt-tmp." + std::to_string(::getpid()) + "." +
                                      fastckpt::temp_host_token() + ".1.0.1");
  write_file_plain(reused, "x");
  // A dead pid whose file a live process still holds locked (another pid namespace): kept.
  const std::string locked = dir.file(".ckpt.pt.fastckpt-tmp.999998." + fastckpt::temp_host_token() + ".7.0.1");
  write_file_plain(locked, "x");
  int lfd = ::open(locked.c_str(), O_WRONLY | O_CLOEXEC);
  CHECK(lfd >= 0 && ::flock(lfd, LOCK_EX | LOCK_NB) == 0);
  // A symlink with a leftover's name is not a leftover.
  const std::string link = dir.file(".ckpt.pt.fastckpt-tmp.999997." + fastckpt::temp_host_token() + ".7.0.1");
  CHECK(::symlink(old_format.c_str(), link.c_str()) == 0);


  const std::string data = random_bytes(200000, 5);
  WriteStats st = save(eng, path, data);
  CHECK_BYTES(read_file(path), data);
  CHECK_EQ(st.leftovers_removed.size(), 2u);
  CHECK(contains(st.leftovers_removed, base(dead2)));
  CHECK(contains(st.leftovers_removed, base(reused)));
  CHECK(!exists(dead2) && !exists(reused));
  CHECK(exists(host_b) && exists(old_format) && exists(locked) && exists(other_target));
  struct stat lst;
  CHECK(::lstat(link.c_str(), &lst) == 0);
  CHECK(exists(live->tmp_path()));
  live->commit();
  CHECK_EQ(read_file(path), std::string("live"));
  ::close(lfd);
  // Unlocked now, its pid dead, this host: the next save takes it.
  WriteStats st2 = save(eng, path, data);
  CHECK_EQ(st2.leftovers_removed.size(), 1u);
  CHECK(!exists(locked));
  CHECK(fastckpt::remove_leftovers(dir.file("other.pt")).size() == 1);
  CHECK(!exists(other_target));
}

TEST(leftovers_of_both_name_formats_are_removed_by_target_and_by_directory, ONCE) {
  TempDir dir;
  const std::string host = fastckpt::temp_host_token();
  const std::string key = fastckpt::temp_key("ckpt.pt");
  const std::string longname(fastckpt::kMaxHexName + 10, 'l');
  const std::string fresh = dir.file(".fastckpt-tmp." + key + ".999999." + host + ".5.0.1");
  const std::string earlier = dir.file(".ckpt.pt.fastckpt-tmp.999999." + host + ".5.1.1");
  const std::string hashed = dir.file(".fastckpt-tmp." + fastckpt::temp_key(longname) + ".999999." + host + ".5.0.2");
  const std::string other = dir.file(".fastckpt-tmp." + fastckpt::temp_key("other.pt") + ".999999." + host + ".5.0.3");
  const std::string foreign = dir.file(".fastckpt-tmp." + key + ".999999.other-host.5.0.4");
  const std::string dcp_dir = dir.file(".fastckpt-tmp." + key + ".999999." + host + ".5.0.5.dcp");
  for (const std::string& f : {fresh, earlier, hashed, other, foreign}) write_file_plain(f, "x");
  CHECK(::mkdir(dcp_dir.c_str(), 0700) == 0);
  std::vector<std::string> r = fastckpt::remove_leftovers(dir.file("ckpt.pt"));
  CHECK_EQ(r.size(), 2u);
  CHECK(contains(r, base(fresh)) && contains(r, base(earlier)));
  CHECK(exists(hashed) && exists(other) && exists(foreign) && exists(dcp_dir));
  CHECK_EQ(fastckpt::remove_leftovers(dir.file(longname)).size(), 1u);
  CHECK(!exists(hashed));
  write_file_plain(hashed, "x");
  r = fastckpt::remove_leftovers_in(dir.path());
  CHECK_EQ(r.size(), 2u);
  CHECK(contains(r, base(hashed)) && contains(r, base(other)));
  CHECK(exists(foreign) && exists(dcp_dir));  // another host's file, a directory: never the engine's to remove
}

TEST(a_concurrent_save_never_removes_a_live_writers_file, ONCE) {
  // Between fdatasync and rename the writer's file stays open and locked, and
  // its pid is alive: however saves interleave, none removes another's file.
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  Engine eng(small(BackendKind::Threads, 8, 2));
  for (int i = 0; i < 20; ++i) {
    Writer a(eng, path, -1), b(eng, path, -1);
    a.append("a", 1);
    b.append("b", 1);
    Writer c(eng, path, -1);  // removes leftovers: must not take a's or b's
    CHECK(c.leftovers_removed().empty());
    a.commit();
    b.commit();
    c.abort();
  }
  CHECK_NO_TEMP_FILES(dir.path());
}

// ------------------------------------------------------------ fork

static void fork_case(BackendKind backend) {
  TempDir dir;
  std::unique_ptr<Engine> eng(new Engine(small(backend)));
  const std::string data = random_bytes(300000, 7);
  save(*eng, dir.file("parent.bin"), data);  // the engine now holds an idle backend (threads / ring)
  pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(30);  // a hang fails the test instead of blocking it
    int rc = 0;
    try {
      Writer w(*eng, dir.file("child.bin"), -1);
      rc = 10;  // the parent's engine must refuse
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("fork") == std::string::npos) rc = 11;
    } catch (...) {
      rc = 12;
    }
    try {
      Engine fresh(small(backend));
      save(fresh, dir.file("child.bin"), data);
      if (load(fresh, dir.file("child.bin"), data.size()) != data) rc = 13;
    } catch (...) {
      rc = 14;
    }
    eng.reset();  // destroying the parent's engine in the child must not hang
    ::_exit(rc);
  }
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  CHECK_MSG(WIFEXITED(status), "child died by signal " + std::to_string(WTERMSIG(status)));
  CHECK_EQ(WEXITSTATUS(status), 0);
  CHECK_BYTES(read_file(dir.file("child.bin")), data);
  // The parent's engine still works.
  save(*eng, dir.file("parent2.bin"), data);
  CHECK_BYTES(load(*eng, dir.file("parent2.bin"), data.size()), data);
  CHECK_POOL_FULL(*eng);
}

TEST(engine_after_fork_threads, ONCE) { fork_case(BackendKind::Threads); }

TEST(engine_after_fork_uring, ONCE) {
  require_uring();
  fork_case(BackendKind::Uring);
}

// ------------------------------------------------------------ io_uring failures

TEST(failed_io_uring_submit_breaks_the_ring, ONCE) {
  require_uring();
  TempDir dir;
  Engine eng(small(BackendKind::Uring, 6, 4));
  const std::string path = dir.file("ckpt.bin");
  const std::string old = random_bytes(70000, 1);
  save(eng, path, old);
  // The 3rd submit fails; its SQE stays in the submission queue, as after a
  // real failure. Reusing that ring would send the stale SQE with the next
  // save's first submit.
  fault::arm(rule(Op::UringSubmit, 3, EIO));
  IoError e = CHECK_THROWS(IoError, save(eng, path, random_bytes(1 << 20, 2), 10007));
  CHECK_EQ(fault::fired(), 1u);
  fault::clear();
  CHECK_EQ(e.err(), EIO);
  CHECK_EQ(e.op(), std::string("io_uring_submit"));
  CHECK_EQ(e.target(), path);
  CHECK_BYTES(read_file(path), old);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
  for (int i = 0; i < 4; ++i) {
    const std::string d = random_bytes((1 << 20) + 4099 * i, 10 + i);
    save(eng, dir.file("next" + std::to_string(i) + ".bin"), d, 10007);
    CHECK_BYTES(read_file(dir.file("next" + std::to_string(i) + ".bin")), d);
    CHECK_POOL_FULL(eng);
  }
}

TEST(unreaped_buffers_never_return_to_the_pool, ONCE) {
  require_uring();
  TempDir dir;
  Engine eng(small(BackendKind::Uring, 8, 4));
  const std::string path = dir.file("ckpt.bin");
  save(eng, path, random_bytes(1000, 1));
  // Every wait fails: completions can no longer be reaped, so the buffers of
  // requests the kernel took may still be in use by it.
  fault::arm(rule(Op::UringWait, 1, EBADR, 0));
  IoError e = CHECK_THROWS(IoError, save(eng, path, random_bytes(1 << 20, 2)));
  fault::clear();
  CHECK_EQ(e.op(), std::string("io_uring_wait_cqe"));
  const size_t lost = eng.pool().quarantined();
  CHECK(lost >= 1 && lost <= 4);
  CHECK_EQ(eng.pool().available(), 8u - lost);
  CHECK_NO_TEMP_FILES(dir.path());
  // A new ring, the remaining buffers: saves still work.
  const std::string d = random_bytes(1 << 20, 3);
  save(eng, path, d);
  CHECK_BYTES(read_file(path), d);
  CHECK_EQ(eng.pool().available(), 8u - lost);
}

// ------------------------------------------------------------ inputs

TEST(size_knobs_that_overflow_are_refused_naming_the_variable, ONCE) {
  auto refused = [](const char* name, const char* value, const char* text) {
    ::setenv(name, value, 1);
    UsageError e = CHECK_THROWS(UsageError, EngineConfig::from_env());
    ::unsetenv(name);
    CHECK_CONTAINS(std::string(e.what()), name);
    CHECK_CONTAINS(std::string(e.what()), text);
  };
  refused("FASTCKPT_BUFFER_SIZE", "17179869184G", "too large");       // 2^64 after the suffix
  refused("FASTCKPT_BUFFER_SIZE", "99999999999999999999999", "too large");
  refused("FASTCKPT_BUFFER_SIZE", "-4096", "not a size");
  refused("FASTCKPT_BUFFER_SIZE", " 4096", "not a size");
  refused("FASTCKPT_QUEUE_DEPTH", "4294967297", "too large");          // wrapped to 1 before
  refused("FASTCKPT_IO_THREADS", "4294967300", "too large");
  refused("FASTCKPT_BUFFER_COUNT", "-1", "not a size");
  refused("FASTCKPT_FLUSH_INTERVAL", "20000000000G", "too large");
  ::setenv("FASTCKPT_BUFFER_SIZE", "1G", 1);
  ::setenv("FASTCKPT_BUFFER_COUNT", "4096", 1);  // 4 TiB of staging buffers
  UsageError e = CHECK_THROWS(UsageError, EngineConfig::from_env());
  ::unsetenv("FASTCKPT_BUFFER_SIZE");
  ::unsetenv("FASTCKPT_BUFFER_COUNT");
  CHECK_CONTAINS(std::string(e.what()), "FASTCKPT_BUFFER_SIZE x FASTCKPT_BUFFER_COUNT");
}

TEST(writes_past_the_largest_offset_are_refused, ONCE) {
  // Without the check these would zero-fill towards 2^64: a file size limit
  // makes that an EFBIG IoError instead of a full disk.
  struct rlimit old_lim;
  ::getrlimit(RLIMIT_FSIZE, &old_lim);
  struct rlimit lim = old_lim;
  lim.rlim_cur = 4u << 20;
  ::setrlimit(RLIMIT_FSIZE, &lim);
  ::signal(SIGXFSZ, SIG_IGN);
  TempDir dir;
  Engine eng(small(BackendKind::Threads));
  {
    Writer w(eng, dir.file("f.bin"), -1);
    w.append("abc", 3);
    CHECK_THROWS(UsageError, w.write_at("x", 1, UINT64_MAX - 10));
    CHECK_THROWS(UsageError, w.append_zeros(UINT64_MAX - 1));
    w.append("d", 1);  // still usable: the refused calls wrote nothing
    w.commit();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_lim);
  ::signal(SIGXFSZ, SIG_DFL);
  CHECK_EQ(read_file(dir.file("f.bin")), std::string("abcd"));
}

FCT_MAIN()
