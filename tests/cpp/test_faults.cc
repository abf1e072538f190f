// Injected faults (fault.h) on every step of a save and a load. A failed save
// must throw an IoError naming the operation, path, offset and errno, leave no
// temporary file, leak no descriptor or staging buffer, leave the previous
// file under the final name untouched, and leave the engine usable. Short
// transfers and EINTR/EAGAIN storms must be absorbed.
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>

#include "temp_file.h"
#include "util.h"

using namespace fct;
using fault::Op;

namespace {

struct WriteFault {
  fault::Rule rule;
  const char* op;            // expected IoError::op()
  int err;                   // expected IoError::err()
  size_t size = 1u << 20;    // bytes saved
  int64_t expected = -1;     // Writer's expected_size (>= 0 preallocates)
  bool has_offset = true;    // the message carries "off="
  bool temp_path = true;     // the error names the temporary file
  uint64_t flush_interval = 0;
  bool lent = false;         // the data lent to the writer (Writer::append_borrowed) after a 1000-byte head
  bool drained = false;      // lent in two halves, Writer::drain() between them, then the first half's
                             // memory overwritten (a fault may surface in the drain)
};

// A save of `data` whose bytes after a 1000-byte head are lent to the writer from memory at their
// file phase: under O_DIRECT their aligned body is written straight from that memory.
// With `drained`, the lent bytes go in two halves with Writer::drain() between them, and the first
// half's memory is overwritten right after the drain: the file must hold the bytes lent, not those.
WriteStats save_lent(Engine& eng, const std::string& path, const std::string& data, int64_t expected,
                     bool drained = false) {
  const size_t head = std::min<size_t>(1000, data.size());
  AlignedBuf mem(data.size() + 4096);
  std::memcpy(mem.p + head, data.data() + head, data.size() - head);
  Writer w(eng, path, expected);  // goes before `mem` does: an aborted save reaps its requests first
  w.append(data.data(), head);
  uint32_t crc = 0;
  const size_t n = data.size() - head;
  const size_t first = drained ? n / 2 / 4096 * 4096 : n;  // the second half keeps the file phase
  w.append_borrowed(mem.p + head, first, &crc);
  if (drained) {
    w.drain();
    std::memset(mem.p + head, 0xA5, first);  // no request reads it any more
    w.append_borrowed(mem.p + head + first, n - first, &crc);
  }
  WriteStats st = w.commit();
  if (drained) std::memcpy(mem.p + head, data.data() + head, first);
  CHECK_EQ(crc, fastckpt::crc32(0, data.data() + head, n));
  CHECK_BYTES(mem.str(head, n), data.substr(head));  // only read
  return st;
}

// Saves over an existing file with `f.rule` armed and checks everything a
// failed save must guarantee, then that the engine saves correctly again.
void run_write_fault(const WriteFault& f) {
  EngineConfig cfg = config();
  cfg.flush_interval = f.flush_interval;
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("ckpt.bin");
  const std::string old = random_bytes(70000, 1);
  save(eng, path, old);  // the previous checkpoint; also creates the backend
  const size_t fds = count_fds();
  const std::string data = random_bytes(f.size, 2);
  auto save_new = [&] {
    return f.lent ? save_lent(eng, path, data, f.expected, f.drained) : save(eng, path, data, 10007, f.expected);
  };

  fault::arm(f.rule);
  IoError e = CHECK_THROWS(IoError, save_new());
  CHECK(fault::fired() >= 1);
  fault::clear();

  CHECK_EQ(e.err(), f.err);
  CHECK_EQ(e.op(), std::string(f.op));
  const std::string what = e.what();
  CHECK_CONTAINS(what, std::string(f.op) + " ");
  CHECK_CONTAINS(what, e.path());
  CHECK_CONTAINS(what, std::string(": ") + std::strerror(f.err));
  CHECK_CONTAINS(e.path(), dir.path() + "/");
  // The file the call failed on: the user's, or its temporary (whose name holds the target's key).
  CHECK(e.path().find("ckpt.bin") != std::string::npos ||
        e.path().find(fastckpt::temp_key("ckpt.bin")) != std::string::npos);
  // The error names the user's file, whatever file the call failed on.
  CHECK_EQ(e.target(), path);
  CHECK_CONTAINS(what, path);
  if (f.temp_path && e.op() != "rename") CHECK_CONTAINS(what, " (saving " + path + ")");
  if (f.temp_path) CHECK_CONTAINS(e.path(), ".fastckpt-tmp.");
  if (f.has_offset) {
    CHECK_CONTAINS(what, " off=" + std::to_string(e.offset()));
    CHECK(e.offset() >= 0);
    CHECK(static_cast<uint64_t>(e.offset()) <= f.size + cfg.buffer_size);
  } else {
    CHECK(what.find("off=") == std::string::npos);
  }

  CHECK_EQ(count_fds(), fds);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_BYTES(read_file(path), old);
  CHECK_POOL_FULL(eng);
  CHECK_EQ(list_dir(dir.path()).size(), 1u);

  // The engine recovers: the same save now succeeds.
  WriteStats st = save_new();
  CHECK_EQ(st.bytes, data.size());
  if (f.lent && cfg.direct) CHECK(st.borrowed_bytes > 0);
  CHECK_BYTES(read_file(path), data);
  CHECK_BYTES(load(eng, path, data.size()), data);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
  CHECK_EQ(count_fds(), fds);
}

}  // namespace

// ------------------------------------------------------------ write errors

TEST(enospc_on_first_data_write, ALL) {
  run_write_fault({rule(Op::Write, 1, ENOSPC), "pwrite", ENOSPC});
}

TEST(eio_on_a_write_in_mid_stream, ALL) {
  // 16 buffer-sized writes; the 7th fails while others are in flight.
  run_write_fault({rule(Op::Write, 7, EIO), "pwrite", EIO});
}

TEST(eio_on_a_lent_write_in_mid_stream, ALL) {
  // Writes straight from the caller's memory: the one that fails is reaped with the others in
  // flight before the save throws, and the memory is the caller's again.
  WriteFault f{rule(Op::Write, 7, EIO), "pwrite", EIO};
  f.lent = true;
  run_write_fault(f);
}

TEST(eio_on_a_lent_write_surfaces_in_a_drain, ALL) {
  // The first half's writes (its staged head, then two lent ones: fewer than the queue holds) are
  // all in flight when drain() is called: the drain reaps the failed one and throws like any
  // failed write; the memory is overwritten only after the retry's drain.
  WriteFault f{rule(Op::Write, 2, EIO), "pwrite", EIO, 201000};
  f.lent = true;
  f.drained = true;
  run_write_fault(f);
}

TEST(enospc_on_every_lent_write_from_the_third_on, ALL) {
  WriteFault f{rule(Op::Write, 3, ENOSPC, 0), "pwrite", ENOSPC};
  f.lent = true;
  run_write_fault(f);
}

TEST(eio_on_fdatasync_after_lent_writes, ALL) {
  WriteFault f{rule(Op::Fsync, 1, EIO), "fdatasync", EIO};
  f.lent = true;
  f.has_offset = false;
  run_write_fault(f);
}

TEST(eio_on_every_write_from_the_third_on, ALL) {
  run_write_fault({rule(Op::Write, 3, EIO, 0), "pwrite", EIO});
}

TEST(enospc_on_the_last_partial_write_at_commit, ALL) {
  // 3 full buffers and a 100-byte tail written by commit().
  WriteFault f{rule(Op::Write, 4, ENOSPC), "pwrite", ENOSPC};
  f.size = 3 * (64u << 10) + 100;
  run_write_fault(f);
}

TEST(eio_on_the_first_o_direct_write, DIRECT) {
  (void)direct_config();  // skips under --buffered
  // Not EINVAL, so not a fallback: the save fails.
  run_write_fault({rule(Op::Write, 1, EIO), "pwrite", EIO});
}

TEST(eio_on_fdatasync, ALL) {
  WriteFault f{rule(Op::Fsync, 1, EIO), "fdatasync", EIO};
  f.has_offset = false;
  run_write_fault(f);
}

TEST(enospc_on_an_asynchronous_flush, ALL) {
  // flush_interval issues fdatasync through the I/O queue while writing.
  WriteFault f{rule(Op::Fsync, 1, ENOSPC), "fdatasync", ENOSPC};
  f.flush_interval = 128u << 10;
  f.has_offset = false;
  run_write_fault(f);
}

TEST(eio_on_rename, ALL) {
  WriteFault f{rule(Op::Rename, 1, EIO), "rename", EIO};
  f.has_offset = false;
  run_write_fault(f);
}

TEST(enospc_on_fallocate, ALL) {
  WriteFault f{rule(Op::Fallocate, 1, ENOSPC), "fallocate", ENOSPC};
  f.expected = static_cast<int64_t>(f.size);
  run_write_fault(f);
}

TEST(eio_on_ftruncate, ALL) {
  // Preallocation (and under O_DIRECT the padded tail) makes commit() truncate
  // the file to its true length.
  WriteFault f{rule(Op::Truncate, 1, EIO), "ftruncate", EIO};
  f.size = (1u << 20) + 5;
  f.expected = static_cast<int64_t>(f.size) + 100000;
  run_write_fault(f);
}

TEST(eacces_on_open, ALL) {
  WriteFault f{rule(Op::Open, 1, EACCES), "open", EACCES};
  f.has_offset = false;
  run_write_fault(f);
}

TEST(a_failed_writer_cleans_up_at_once_not_only_when_destroyed, ALL) {
  // engine.h: "abort() (or destruction without commit, or any error) removes"
  // the temporary file. Checked while the failed Writer is still alive.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("alive.bin");
  const std::string data = random_bytes(500000, 3);
  save(eng, path, data);
  const size_t fds = count_fds();
  struct Case {
    fault::Rule r;
    bool fails_in_append;
  };
  for (Case c : {Case{rule(Op::Write, 2, EIO), true}, Case{rule(Op::Fsync, 1, EIO), false},
                 Case{rule(Op::Rename, 1, ENOSPC), false}, Case{rule(Op::Truncate, 1, EIO), false}}) {
    fault::clear();
    fault::arm(c.r);
    Writer w(eng, path, static_cast<int64_t>(data.size()) + 1);
    if (c.fails_in_append) {
      CHECK_THROWS(IoError, w.append(data.data(), data.size()));
    } else {
      w.append(data.data(), data.size());
      CHECK_THROWS(IoError, w.commit());
    }
    CHECK(fault::fired() >= 1);
    CHECK(!exists(w.tmp_path()));
    CHECK_NO_TEMP_FILES(dir.path());
    CHECK_EQ(count_fds(), fds);
    CHECK_POOL_FULL(eng);
    CHECK_THROWS(UsageError, w.commit());
  }
  fault::clear();
  CHECK_BYTES(read_file(path), data);
}

TEST(directory_fsync_failure_after_rename, ALL) {
  // fdatasync of the file is Fsync #1, the directory's fsync #2. By then the
  // new file has been renamed over the old one: the error is reported, and
  // the final name holds one complete version; nothing else is left behind.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("ckpt.bin");
  const std::string old = random_bytes(5000, 1), data = random_bytes(300000, 2);
  save(eng, path, old);
  const size_t fds = count_fds();
  fault::arm(rule(Op::Fsync, 2, EIO));
  IoError e = CHECK_THROWS(IoError, save(eng, path, data));
  fault::clear();
  CHECK_EQ(e.err(), EIO);
  CHECK_EQ(e.op(), std::string("fsync"));
  CHECK_EQ(e.path(), dir.path());
  CHECK_EQ(e.target(), path);  // the error names the user's file too
  CHECK_CONTAINS(std::string(e.what()), "fsync " + dir.path() + " (saving " + path + "): " + std::strerror(EIO));
  std::string now = read_file(path);
  CHECK_MSG(now == old || now == data, "the final name holds neither the old nor the new file");
  CHECK_EQ(count_fds(), fds);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
  save(eng, path, old);
  CHECK_BYTES(read_file(path), old);
}

TEST(real_efbig_from_the_kernel, ALL) {
  // Not injected: RLIMIT_FSIZE makes the kernel refuse writes past 256 KiB.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("big.bin");
  const std::string old = random_bytes(1000, 3);
  save(eng, path, old);
  const size_t fds = count_fds();
  struct rlimit saved;
  CHECK_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  struct rlimit lim = saved;
  lim.rlim_cur = 256u << 10;
  void (*old_handler)(int) = ::signal(SIGXFSZ, SIG_IGN);
  CHECK_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string err;
  int code = 0;
  std::string epath;
  try {
    save(eng, path, random_bytes(1u << 20, 4));
    err = "save past RLIMIT_FSIZE succeeded";
  } catch (const IoError& e) {
    code = e.err();
    epath = e.path();
    err = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  CHECK_EQ(code, EFBIG);
  CHECK_CONTAINS(err, "pwrite ");
  CHECK_CONTAINS(err, " off=");
  CHECK_CONTAINS(epath, ".fastckpt-tmp.");
  CHECK_EQ(count_fds(), fds);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_BYTES(read_file(path), old);
  CHECK_POOL_FULL(eng);
}

// ------------------------------------------------------------ absorbed faults

TEST(short_writes_are_requeued, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("short.bin");
  const std::string data = random_bytes((1u << 20) + 3333, 5);
  fault::arm(short_rule(Op::Write, 1, short_unit(), 0));  // every write comes back short
  WriteStats st = save(eng, path, data, 9999);
  CHECK(fault::fired() > 0);
  CHECK(st.requeued > 0);
  fault::clear();
  CHECK_BYTES(read_file(path), data);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
}

TEST(zero_length_write_is_an_error_not_a_hang, ALL) {
  // A write that makes no progress at all must fail (EIO), not loop forever.
  WriteFault f{short_rule(Op::Write, 2, 0, 0), "pwrite", EIO};
  run_write_fault(f);
}

TEST(eintr_storm_on_writes_is_retried, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("eintr.bin");
  const std::string data = random_bytes((1u << 20) + 1, 6);
  // From the second write on: the first write of an O_DIRECT file is made
  // synchronously (its EINTRs are retried in place, not requeued).
  fault::arm(rule(Op::Write, 2, EINTR, 50));
  WriteStats st = save(eng, path, data);
  CHECK_EQ(fault::fired(), 50u);
  CHECK(st.requeued >= 50);
  CHECK_BYTES(read_file(path), data);
  CHECK_POOL_FULL(eng);
}

TEST(eagain_storm_on_writes_is_retried, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("eagain.bin");
  const std::string data = random_bytes(777777, 7);
  fault::arm(rule(Op::Write, 3, EAGAIN, 50));
  WriteStats st = save(eng, path, data, 4097);
  CHECK_EQ(fault::fired(), 50u);
  CHECK(st.requeued >= 50);
  CHECK_BYTES(read_file(path), data);
}

TEST(eintr_storm_on_asynchronous_flush_is_retried, ALL) {
  EngineConfig cfg = config();
  cfg.flush_interval = 128u << 10;
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("flush.bin");
  const std::string data = random_bytes(1u << 20, 8);
  fault::arm(rule(Op::Fsync, 1, EINTR, 50));
  save(eng, path, data);
  CHECK_EQ(fault::fired(), 50u);
  CHECK_BYTES(read_file(path), data);
}

TEST(short_reads_are_requeued, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("sr.bin");
  const size_t n = (1u << 20) + 4444;
  const std::string data = random_bytes(n, 9);
  save(eng, path, data);
  fault::arm(short_rule(Op::Read, 1, short_unit(), 0));
  CHECK_BYTES(load(eng, path, n), data);
  // Scattered ranges and an aligned (direct) one.
  std::string out(n, '\0');
  AlignedBuf al(8 * 4096);
  std::vector<ReadRange> rs = {{&out[5], 100000, 5}, {&out[500000], 3, 500000}, {&out[n - 10], 10, n - 10},
                               {al.p, 8 * 4096, 4096 * 20}};
  fastckpt::read_ranges(eng, path, rs);
  CHECK(fault::fired() > 0);
  fault::clear();
  CHECK_BYTES(out.substr(5, 100000), data.substr(5, 100000));
  CHECK_BYTES(out.substr(500000, 3), data.substr(500000, 3));
  CHECK_BYTES(out.substr(n - 10), data.substr(n - 10));
  CHECK_BYTES(al.str(0, 8 * 4096), data.substr(4096 * 20, 8 * 4096));
  CHECK_POOL_FULL(eng);
}

TEST(eintr_storm_on_reads_is_retried, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("er.bin");
  const size_t n = 654321;
  const std::string data = random_bytes(n, 10);
  save(eng, path, data);
  evict(path);  // the disk path: read_ranges copies cached bytes from the page cache
  fault::arm(rule(Op::Read, 2, EINTR, 50));
  CHECK_BYTES(load(eng, path, n), data);
  CHECK_EQ(fault::fired(), 50u);
}

// ------------------------------------------------------------ read errors

namespace {

// Arms `r`, reads ranges of a 1 MiB file and checks the IoError, then that
// nothing leaked and the same read succeeds.
void run_read_fault(const fault::Rule& r, int err) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("data.bin");
  const size_t n = 1u << 20;
  const std::string data = random_bytes(n, 11);
  save(eng, path, data);
  CHECK_BYTES(load(eng, path, n), data);  // the backend exists from here on
  const size_t fds = count_fds();
  std::string out(n, '\0');
  std::vector<ReadRange> rs;
  for (size_t off = 0; off < n; off += 100000) rs.push_back({&out[off], std::min<size_t>(100000, n - off), off});
  fault::arm(r);
  IoError e = CHECK_THROWS(IoError, fastckpt::read_ranges(eng, path, rs));
  CHECK(fault::fired() >= 1);
  fault::clear();
  CHECK_EQ(e.err(), err);
  CHECK_EQ(e.op(), std::string("pread"));
  CHECK_EQ(e.path(), path);
  const std::string what = e.what();
  CHECK_CONTAINS(what, "pread " + path + " off=");
  CHECK_CONTAINS(what, std::string(": ") + std::strerror(err));
  CHECK(e.offset() >= 0 && static_cast<uint64_t>(e.offset()) < n);
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(eng);
  fastckpt::read_ranges(eng, path, rs);
  CHECK_BYTES(out, data);
}

}  // namespace

TEST(eio_on_first_read, ALL) { run_read_fault(rule(Op::Read, 1, EIO), EIO); }

TEST(eio_on_a_read_in_mid_stream, ALL) { run_read_fault(rule(Op::Read, 5, EIO), EIO); }

TEST(eio_on_every_read, ALL) { run_read_fault(rule(Op::Read, 1, EIO, 0), EIO); }

TEST(range_past_end_of_file_is_truncated_error, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("short.bin");
  const std::string data = random_bytes(10000, 12);
  save(eng, path, data);
  const size_t fds = count_fds();
  std::string out(20000, '\0');
  struct Case {
    uint64_t off, len;
  };
  for (Case c : {Case{0, 10001}, Case{0, 20000}, Case{9999, 2}, Case{10000, 1}, Case{50000, 10},
                 Case{UINT64_MAX - 5, 10}}) {
    std::vector<ReadRange> rs = {{&out[0], 10, 0}, {&out[0], c.len, c.off}};
    TruncatedError e = CHECK_THROWS(TruncatedError, fastckpt::read_ranges(eng, path, rs));
    CHECK_EQ(e.path(), path);
    const std::string what = e.what();
    CHECK_CONTAINS(what, path);
    CHECK_CONTAINS(what, "truncated");
    CHECK_CONTAINS(what, "(10000 bytes)");
    if (c.off < 50000) CHECK_CONTAINS(what, "off=" + std::to_string(c.off));
  }
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(eng);
  // The exact end is fine.
  fastckpt::read_ranges(eng, path, {{&out[0], 10000, 0}});
  CHECK_BYTES(out.substr(0, 10000), data);
}

TEST(file_shrinking_during_read_is_truncated_error, ALL) {
  // A read that hits end of file before the range is complete (the file was
  // truncated after it was opened), simulated by a zero-length read.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("shrink.bin");
  const std::string data = random_bytes(300000, 13);
  save(eng, path, data);
  evict(path);  // the disk path: read_ranges copies cached bytes from the page cache
  const size_t fds = count_fds();
  // Every page-cache read misses, whatever DONTNEED left cached: the disk path
  // (a cached read treats a zero-length transfer as a retry, as pread_full).
  fault::arm(rule(Op::ReadCached, 1, EAGAIN, 0));
  fault::arm(short_rule(Op::Read, 2, 0, 1));
  std::string out(300000, '\0');
  TruncatedError e = CHECK_THROWS(
      TruncatedError, fastckpt::read_ranges(eng, path, {{&out[0], 100000, 0}, {&out[200000], 100000, 200000}}));
  CHECK_EQ(e.path(), path);
  CHECK_CONTAINS(std::string(e.what()), "truncated");
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(eng);
}

TEST(missing_file_is_enoent, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("nope.bin");
  char b[4];
  IoError e = CHECK_THROWS(IoError, fastckpt::read_ranges(eng, path, {{b, 4, 0}}));
  CHECK_EQ(e.err(), ENOENT);
  CHECK_EQ(e.op(), std::string("open"));
  CHECK_EQ(e.path(), path);
  CHECK_CONTAINS(std::string(e.what()), "open " + path + ": " + std::strerror(ENOENT));
  CHECK_POOL_FULL(eng);
}

TEST(read_falls_back_to_buffered_when_o_direct_open_is_refused, DIRECT) {
  EngineConfig cfg = direct_config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("rf.bin");
  const std::string data = random_bytes(200000, 14);
  save(eng, path, data);
  fault::arm(rule(Op::Open, 1, EINVAL));
  AlignedBuf al(200000);
  ReadStats st = fastckpt::read_ranges(eng, path, {{al.p, 200000, 0}});
  CHECK_EQ(fault::fired(), 1u);
  CHECK(!st.direct);
  CHECK_EQ(st.direct_requests, 0u);
  CHECK_BYTES(al.str(0, 200000), data);
}

// ------------------------------------------------------------ O_DIRECT fallback

TEST(o_direct_open_einval_falls_back_to_buffered, DIRECT) {
  EngineConfig cfg = direct_config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("fb.bin");
  const std::string data = random_bytes(300001, 15);
  fault::arm(rule(Op::Open, 1, EINVAL));
  WriteStats st = save(eng, path, data, 7777, static_cast<int64_t>(data.size()));
  CHECK_EQ(fault::fired(), 1u);
  CHECK(!st.direct);
  CHECK_EQ(st.alignment, 0u);
  CHECK(!st.fallback.empty());
  CHECK_CONTAINS(st.fallback, "EINVAL");
  CHECK_BYTES(read_file(path), data);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
  fault::clear();
  // The next save uses O_DIRECT again.
  st = save(eng, path, data);
  CHECK(st.direct);
  CHECK(st.fallback.empty());
}

TEST(o_direct_write_einval_falls_back_to_buffered, DIRECT) {
  EngineConfig cfg = direct_config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("fbw.bin");
  const std::string data = random_bytes(300003, 16);
  fault::arm(rule(Op::Write, 1, EINVAL));  // the Writer's first write: O_DIRECT refused
  WriteStats st = save(eng, path, data, 7777);
  CHECK_EQ(fault::fired(), 1u);
  CHECK(!st.direct);
  CHECK(!st.fallback.empty());
  CHECK_CONTAINS(st.fallback, "write");
  CHECK_CONTAINS(st.fallback, "EINVAL");
  CHECK_BYTES(read_file(path), data);
  CHECK_EQ(file_size(path), static_cast<int64_t>(data.size()));
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
}

TEST(einval_on_a_data_write_is_an_error_not_a_fallback, DIRECT) {
  (void)direct_config();  // skips under --buffered
  // Only the probe's EINVAL means "O_DIRECT refused"; later it is an error.
  run_write_fault({rule(Op::Write, 3, EINVAL), "pwrite", EINVAL});
}

FCT_MAIN()
