// Backend selection (io_uring refused -> thread pool), misuse of the API,
// configuration parsing, the fault-injection module itself and the sys helpers.
#include <chrono>
#include <cstdlib>
#include <thread>

#include "temp_file.h"
#include "util.h"

using namespace fct;
using fault::Op;
using fastckpt::BackendKind;

namespace {

EngineConfig small(BackendKind backend) {
  EngineConfig c;
  c.buffer_size = 64u << 10;
  c.buffer_count = 2;
  c.queue_depth = 2;
  c.io_threads = 2;
  c.backend = backend;
  c.direct = direct_unavailable_reason().empty();
  return c;
}

}  // namespace

// ------------------------------------------------------------ backends

TEST(auto_backend_prefers_io_uring, ONCE) {
  require_uring();
  Engine eng(small(BackendKind::Auto));
  CHECK_EQ(eng.backend_name(), std::string("io_uring"));
  CHECK_EQ(eng.uring_refusal(), std::string());
  TempDir dir;
  WriteStats st = save(eng, dir.file("a.bin"), random_bytes(1000, 1));
  CHECK_EQ(st.backend, std::string("io_uring"));
}

TEST(threads_backend_when_asked, ONCE) {
  Engine eng(small(BackendKind::Threads));
  CHECK_EQ(eng.backend_name(), std::string("threads"));
  CHECK_EQ(eng.uring_refusal(), std::string());
}

TEST(io_uring_refused_auto_falls_back_to_threads, ONCE) {
  // EPERM is what seccomp or kernel.io_uring_disabled give.
  fault::arm(rule(Op::UringSetup, 1, EPERM, 0));
  Engine eng(small(BackendKind::Auto));
  CHECK_EQ(eng.backend_name(), std::string("threads"));
  const std::string why = eng.uring_refusal();
  CHECK(!why.empty());
  CHECK_CONTAINS(why, "io_uring_queue_init");
  if (fastckpt::uring_compiled()) {
    CHECK_EQ(fault::fired(), 1u);
    CHECK_CONTAINS(why, std::strerror(EPERM));
  } else {
    CHECK_CONTAINS(why, std::strerror(ENOSYS));
  }
  TempDir dir;
  const std::string data = random_bytes(200000, 2);
  WriteStats st = save(eng, dir.file("fb.bin"), data);
  CHECK_EQ(st.backend, std::string("threads"));
  CHECK_BYTES(read_file(dir.file("fb.bin")), data);
  ReadStats rs;
  evict(dir.file("fb.bin"));  // the disk path: read_ranges copies cached bytes from the page cache
  CHECK_BYTES(load(eng, dir.file("fb.bin"), data.size(), &rs), data);
  CHECK_EQ(rs.backend, std::string("threads"));
  // The refusal is remembered: io_uring is not tried again for every save.
  const uint64_t fired = fault::fired();
  save(eng, dir.file("fb2.bin"), data);
  CHECK_EQ(fault::fired(), fired);
}

TEST(io_uring_refused_explicit_backend_throws, ONCE) {
  if (!fastckpt::uring_compiled()) SKIP("fastckpt was built without liburing");
  fault::arm(rule(Op::UringSetup, 1, EPERM, 0));
  Engine eng(small(BackendKind::Uring));
  TempDir dir;
  const size_t fds = count_fds();
  IoError e = CHECK_THROWS(IoError, Writer(eng, dir.file("x.bin"), -1));
  CHECK_EQ(e.err(), EPERM);
  CHECK_EQ(e.op(), std::string("io_uring_queue_init"));
  CHECK_CONTAINS(std::string(e.what()), std::strerror(EPERM));
  IoError e2 = CHECK_THROWS(IoError, eng.backend_name());
  CHECK_EQ(e2.err(), EPERM);
  // A read that needs the disk (a cached one needs no backend).
  TempDir other;
  write_file_plain(other.file("r.bin"), "abc");
  evict(other.file("r.bin"));
  char b[1];
  IoError e3 = CHECK_THROWS(IoError, fastckpt::read_ranges(eng, other.file("r.bin"), {{b, 1, 0}}));
  CHECK_EQ(e3.err(), EPERM);
  CHECK_EQ(count_fds(), fds);
  CHECK(list_dir(dir.path()).empty());
  CHECK_POOL_FULL(eng);
}

TEST(without_liburing_explicit_uring_is_enosys, ONCE) {
  if (fastckpt::uring_compiled()) SKIP("fastckpt was built with liburing");
  IoError e = CHECK_THROWS(IoError, fastckpt::make_uring_backend(4, {}));
  CHECK_EQ(e.err(), ENOSYS);
  Engine eng(small(BackendKind::Uring));
  CHECK_THROWS(IoError, eng.backend_name());
}

// ------------------------------------------------------------ misuse

TEST(write_at_behind_position_is_usage_error, ONCE) {
  Engine eng(small(BackendKind::Threads));
  TempDir dir;
  Writer w(eng, dir.file("w.bin"), -1);
  std::string d = random_bytes(100, 1);
  w.append(d.data(), d.size());
  UsageError e = CHECK_THROWS(UsageError, w.write_at(d.data(), 1, 99));
  CHECK_CONTAINS(std::string(e.what()), "behind");
  // The writer is still usable afterwards.
  w.write_at(d.data(), 10, 100);
  w.commit();
  CHECK_BYTES(read_file(dir.file("w.bin")), d + d.substr(0, 10));
}

TEST(commit_twice_and_use_after_commit_are_usage_errors, ONCE) {
  Engine eng(small(BackendKind::Threads));
  TempDir dir;
  Writer w(eng, dir.file("c.bin"), -1);
  w.append("abc", 3);
  w.commit();
  UsageError e = CHECK_THROWS(UsageError, w.commit());
  CHECK_CONTAINS(std::string(e.what()), "already committed");
  CHECK_THROWS(UsageError, w.append("x", 1));
  CHECK_THROWS(UsageError, w.append_zeros(1));
  CHECK_THROWS(UsageError, w.write_at("x", 1, 100));
  w.abort();  // a no-op after commit
  CHECK_EQ(read_file(dir.file("c.bin")), std::string("abc"));
}

TEST(writer_destroyed_without_commit_removes_its_temp_file, ONCE) {
  Engine eng(small(BackendKind::Threads));
  TempDir dir;
  const std::string path = dir.file("d.bin");
  write_file_plain(path, "previous");
  const size_t fds = count_fds();
  std::string tmp;
  {
    Writer w(eng, path, 1000000);
    tmp = w.tmp_path();
    std::string d = random_bytes(300000, 3);
    w.append(d.data(), d.size());
    CHECK(exists(tmp));
  }
  CHECK(!exists(tmp));
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_EQ(read_file(path), std::string("previous"));
  CHECK_POOL_FULL(eng);
  // One backend is now idle in the engine (threads: no descriptor).
  CHECK_EQ(count_fds(), fds);
}

TEST(abort_removes_temp_file_and_later_use_is_usage_error, ONCE) {
  Engine eng(small(BackendKind::Threads));
  TempDir dir;
  Writer w(eng, dir.file("a.bin"), -1);
  w.append("abc", 3);
  w.abort();
  w.abort();
  CHECK(!exists(w.tmp_path()));
  UsageError e = CHECK_THROWS(UsageError, w.commit());
  CHECK_CONTAINS(std::string(e.what()), "aborted");
  CHECK(list_dir(dir.path()).empty());
  CHECK_POOL_FULL(eng);
}

TEST(same_thread_holding_every_buffer_is_an_error_not_a_hang, ONCE) {
  Engine eng(small(BackendKind::Threads));  // 2 buffers, queue depth 2
  TempDir dir;
  const std::string other = random_bytes(100000, 7);
  save(eng, dir.file("other.bin"), other);
  Writer w(eng, dir.file("w.bin"), -1);
  const std::string d = random_bytes(300000, 8);
  w.append(d.data(), d.size());  // the writer now holds both staging buffers
  std::string dst(other.size() + 1, '\0');  // misaligned: reads go through staging buffers
  UsageError e = CHECK_THROWS(UsageError, fastckpt::read_ranges(eng, dir.file("other.bin"),
                                                                {{&dst[1], other.size(), 0}}));
  CHECK_CONTAINS(std::string(e.what()), "this same thread");
  // A second writer of this thread (its first append needs a buffer).
  CHECK_THROWS(UsageError, [&] {
    Writer w2(eng, dir.file("w2.bin"), -1);
    w2.append(d.data(), d.size());
  }());
  CHECK_EQ(list_dir(dir.path()).size(), size_t(2));  // other.bin and w's temporary file
  // The first writer is unharmed.
  w.commit();
  CHECK_BYTES(read_file(dir.file("w.bin")), d);
  CHECK_POOL_FULL(eng);

  // Another thread waits for the buffers instead, and gets them once the writer commits.
  Writer w3(eng, dir.file("w3.bin"), -1);
  w3.append(d.data(), d.size());
  std::string got(other.size() + 1, '\0');
  std::thread reader([&] { fastckpt::read_ranges(eng, dir.file("other.bin"), {{&got[1], other.size(), 0}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  w3.commit();
  reader.join();
  CHECK_BYTES(got.substr(1), other);
  CHECK_POOL_FULL(eng);
}

TEST(bad_paths, ONCE) {
  Engine eng(small(BackendKind::Threads));
  TempDir dir;
  CHECK_THROWS(UsageError, Writer(eng, "", -1));
  CHECK_THROWS(UsageError, Writer(eng, dir.path() + "/", -1));
  IoError e = CHECK_THROWS(IoError, Writer(eng, dir.file("no/such/dir/x.bin"), -1));
  CHECK_EQ(e.err(), ENOENT);
  CHECK_EQ(e.op(), std::string("open"));
  CHECK_CONTAINS(e.path(), dir.path() + "/no/such/dir/.fastckpt-tmp." + fastckpt::temp_key("x.bin") + ".");
  CHECK_CONTAINS(e.what(), dir.file("no/such/dir/x.bin"));  // and the error names the user's file
  CHECK_THROWS(UsageError, Writer(eng, dir.file("n.bin"), -1).append(nullptr, 1));
  char b[4];
  write_file_plain(dir.file("r.bin"), "abcd");
  CHECK_THROWS(UsageError, fastckpt::read_ranges(eng, dir.file("r.bin"), {{b, 4, 0}, {nullptr, 1, 0}}));
  CHECK_POOL_FULL(eng);
  CHECK_NO_TEMP_FILES(dir.path());
}

// ------------------------------------------------------------ configuration

TEST(config_validation, ONCE) {
  EngineConfig c;
  c.validate();
  auto bad = [](void (*mutate)(EngineConfig&)) {
    EngineConfig x;
    mutate(x);
    CHECK_THROWS(UsageError, x.validate());
    CHECK_THROWS(UsageError, Engine(x));
  };
  bad([](EngineConfig& x) { x.buffer_size = 1000; });
  bad([](EngineConfig& x) { x.buffer_size = 0; });
  bad([](EngineConfig& x) { x.buffer_size = 4096 * 3 + 1; });
  bad([](EngineConfig& x) { x.buffer_count = 0; });
  bad([](EngineConfig& x) { x.queue_depth = 0; });
  bad([](EngineConfig& x) { x.io_threads = 0; });
  CHECK_EQ(fastckpt::parse_size("8M", "x"), 8ull << 20);
  CHECK_EQ(fastckpt::parse_size("64K", "x"), 64ull << 10);
  CHECK_EQ(fastckpt::parse_size("1GiB", "x"), 1ull << 30);
  CHECK_EQ(fastckpt::parse_size("123", "x"), 123ull);
  CHECK_THROWS(UsageError, fastckpt::parse_size("", "x"));
  CHECK_THROWS(UsageError, fastckpt::parse_size("12Q", "x"));
  CHECK_THROWS(UsageError, fastckpt::parse_size("abc", "x"));
  CHECK(fastckpt::backend_kind_from_name("io_uring") == BackendKind::Uring);
  CHECK(fastckpt::backend_kind_from_name("threads") == BackendKind::Threads);
  CHECK(fastckpt::backend_kind_from_name("auto") == BackendKind::Auto);
  CHECK_THROWS(UsageError, fastckpt::backend_kind_from_name("aio"));
}

TEST(config_from_environment, ONCE) {
  const char* names[] = {"FASTCKPT_BUFFER_SIZE", "FASTCKPT_BUFFER_COUNT", "FASTCKPT_QUEUE_DEPTH",
                         "FASTCKPT_BACKEND", "FASTCKPT_DIRECT", "FASTCKPT_FLUSH_INTERVAL", "FASTCKPT_PREFAULT"};
  for (const char* n : names) ::unsetenv(n);
  ::setenv("FASTCKPT_BUFFER_SIZE", "128K", 1);
  ::setenv("FASTCKPT_BUFFER_COUNT", "3", 1);
  ::setenv("FASTCKPT_BACKEND", "threads", 1);
  ::setenv("FASTCKPT_DIRECT", "0", 1);
  ::setenv("FASTCKPT_FLUSH_INTERVAL", "1M", 1);
  CHECK(EngineConfig::from_env().prefault);  // on by default
  ::setenv("FASTCKPT_PREFAULT", "0", 1);
  EngineConfig c = EngineConfig::from_env();
  CHECK(!c.prefault);
  CHECK_EQ(c.buffer_size, static_cast<size_t>(128u << 10));
  CHECK_EQ(c.buffer_count, static_cast<size_t>(3));
  CHECK(c.backend == BackendKind::Threads);
  CHECK(!c.direct);
  CHECK_EQ(c.flush_interval, 1ull << 20);
  ::setenv("FASTCKPT_DIRECT", "maybe", 1);
  CHECK_THROWS(UsageError, EngineConfig::from_env());
  ::setenv("FASTCKPT_DIRECT", "1", 1);
  ::setenv("FASTCKPT_BUFFER_SIZE", "1000", 1);
  CHECK_THROWS(UsageError, EngineConfig::from_env());
  for (const char* n : names) ::unsetenv(n);
}

// ------------------------------------------------------------ fault module, sys

TEST(fault_module, ONCE) {
  CHECK(fault::op_from_name("write") == Op::Write);
  CHECK(fault::op_from_name("uring_setup") == Op::UringSetup);
  CHECK_EQ(std::string(fault::op_name(Op::Truncate)), std::string("truncate"));
  CHECK_THROWS(UsageError, fault::op_from_name("nope"));
  CHECK_THROWS(UsageError, fault::arm(rule(Op::Write, 0, EIO)));
  // nth/times counting, and path filtering.
  fault::Rule r = rule(Op::Read, 2, EIO, 2);
  r.path_contains = "abc";
  fault::arm(r);
  CHECK_EQ(fault::on(Op::Read, "/x/abc").err, 0);
  CHECK_EQ(fault::on(Op::Read, "/x/other").err, 0);
  CHECK_EQ(fault::on(Op::Write, "/x/abc").err, 0);
  CHECK_EQ(fault::on(Op::Read, "/x/abc").err, EIO);
  CHECK_EQ(fault::on(Op::Read, "/x/abc").err, EIO);
  CHECK_EQ(fault::on(Op::Read, "/x/abc").err, 0);
  CHECK_EQ(fault::fired(), 2u);
  fault::clear();
  CHECK_EQ(fault::fired(), 0u);
  CHECK_EQ(fault::on(Op::Read, "/x/abc").err, 0);
}

TEST(sys_full_transfers_absorb_short_io, ONCE) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  const std::string data = random_bytes(100000, 4);
  int fd = fastckpt::sys::open(path, O_RDWR | O_CREAT | O_TRUNC);
  fault::arm(short_rule(Op::Write, 1, 777, 0));
  fastckpt::sys::pwrite_full(fd, data.data(), data.size(), 0, path);
  fault::clear();
  fault::arm(short_rule(Op::Read, 1, 333, 0));
  std::string back(data.size() + 10, '\0');
  uint64_t got = fastckpt::sys::pread_full(fd, &back[0], back.size(), 0, path);  // stops at end of file
  fault::clear();
  fastckpt::sys::close_quiet(fd);
  CHECK_EQ(got, data.size());
  CHECK_BYTES(back.substr(0, got), data);
  CHECK_EQ(fastckpt::sys::dirname("/a/b/c"), std::string("/a/b"));
  CHECK_EQ(fastckpt::sys::dirname("c"), std::string("."));
  CHECK_EQ(fastckpt::sys::dirname("/c"), std::string("/"));
  CHECK_EQ(fastckpt::sys::basename("/a/b/c"), std::string("c"));
  IoError e = CHECK_THROWS(IoError, fastckpt::sys::open(dir.file("missing"), O_RDONLY));
  CHECK_EQ(e.err(), ENOENT);
}

TEST(injected_eintr_on_synchronous_calls_is_retried, ONCE) {
  // sys.h: each wrapper "consults the fault-injection hook, retries EINTR":
  // an EINTR storm armed on open, the first (synchronous) write, fdatasync, the
  // directory fsync, fallocate or ftruncate must not fail the save.
  EngineConfig cfg = small(BackendKind::Threads);
  cfg.direct = true;
  if (!direct_unavailable_reason().empty()) SKIP(direct_unavailable_reason());
  TempDir dir;
  Engine eng(cfg);
  const std::string data = random_bytes(100000, 5);
  struct Case {
    Op op;
    uint64_t nth;
    const char* what;
  };
  std::string failed;
  for (Case c : {Case{Op::Open, 1, "open"}, Case{Op::Write, 1, "first pwrite"}, Case{Op::Fsync, 1, "fdatasync"},
                 Case{Op::Fsync, 2, "directory fsync"}, Case{Op::Fallocate, 1, "fallocate"},
                 Case{Op::Truncate, 1, "ftruncate"}}) {
    fault::clear();
    fault::arm(rule(c.op, c.nth, EINTR, 3));
    try {
      save(eng, dir.file("e.bin"), data, 0, static_cast<int64_t>(data.size()));
      if (read_file(dir.file("e.bin")) != data) failed += std::string(" ") + c.what + "(data)";
    } catch (const IoError& e) {
      failed += std::string(" ") + c.what;
    }
  }
  fault::clear();
  CHECK_MSG(failed.empty(), "an injected EINTR storm failed the save on:" + failed);
}

FCT_MAIN()
