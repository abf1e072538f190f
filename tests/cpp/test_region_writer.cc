// RegionWriter (region_writer.h): the ranks of a collective save fill one
// temporary file, each its own regions at absolute offsets; the creator
// renames it. Here several "ranks" run in one process, each with its own engine.
#include <algorithm>

#include "region_writer.h"
#include "util.h"

using namespace fct;
using fastckpt::RegionStats;
using fastckpt::RegionWriter;
using fault::Op;

namespace {

struct Region {
  uint64_t off, len;
};

// A file of `data.size()` bytes split into regions that three ranks write:
// rank 1 and 2 large 4 KiB-aligned bodies, rank 0 everything else.
std::vector<std::vector<Region>> split(uint64_t n) {
  // [0, 4096) rank 0 (headers); [4096, 4096+A) rank 1; [.., B) rank 2 (aligned bodies);
  // the rest (an unaligned tail) rank 0.
  const uint64_t a = 40960 * 3, b = 4096 + a + 4096 * 20;
  return {{{0, 4096}, {b, n - b}}, {{4096, a}}, {{4096 + a, b - 4096 - a}}};
}

uint32_t crc_of(const std::string& d, const Region& r) { return fastckpt::crc32(0, d.data() + r.off, r.len); }

}  // namespace

TEST(regions_fill_one_file, ALL) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  const std::string old = random_bytes(5000, 7);
  write_file_plain(path, old);
  const std::string data = random_bytes(4096 + 40960 * 3 + 4096 * 20 + 77777, 8);
  auto parts = split(data.size());
  Engine e0(config()), e1(config()), e2(config());
  for (Engine* e : {&e0, &e1, &e2}) e->lease();  // each engine's backend made (and kept) before counting
  const size_t fds = count_fds();

  RegionWriter w0(e0, path, "", true, data.size());
  CHECK(w0.owner());
  CHECK_CONTAINS(w0.tmp_path(), ".fastckpt-tmp.");
  CHECK_EQ(temp_files(dir.path()).size(), 1u);
  Engine* engines[] = {&e0, &e1, &e2};
  std::vector<RegionStats> stats;
  for (int r = 1; r <= 2; ++r) {
    RegionWriter w(*engines[r], path, w0.tmp_path(), false, 0);
    CHECK(!w.owner());
    for (const Region& g : parts[r]) {
      uint32_t crc = 0;
      w.write_at(data.data() + g.off, g.len, g.off, &crc);
      CHECK_EQ(crc, crc_of(data, g));
    }
    stats.push_back(w.finish());
    CHECK_EQ(stats.back().bytes, parts[r][0].len);
    CHECK_POOL_FULL(*engines[r]);
  }
  // Rank 0 writes last (after gathering the others' CRCs, in a real save).
  for (const Region& g : parts[0]) w0.write_at(data.data() + g.off, g.len, g.off);
  CHECK_BYTES(read_file(path), old);  // nothing under the final name yet
  RegionStats st = w0.commit();
  CHECK_EQ(st.bytes, 4096 + (data.size() - parts[0][1].off));
  CHECK_BYTES(read_file(path), data);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(e0);
  CHECK_EQ(st.backend, std::string(expected_backend_name()));
  if (variant().direct && stats[0].direct) {
    // The aligned bodies went O_DIRECT, straight from staging.
    CHECK(stats[0].direct_requests >= 1);
    CHECK_EQ(stats[0].direct_requests, stats[0].requests);
  }
  if (!variant().direct) {
    CHECK(!stats[0].direct);
    CHECK_EQ(stats[0].direct_requests, 0u);
  }
}

// O_DIRECT accepted at open and refused (EINVAL) at the first direct write,
// as some filesystems do: that piece and every later one go buffered.
TEST(direct_refused_at_first_write, DIRECT) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  const std::string data = random_bytes(4096 + 40960 * 3 + 4096 * 20 + 500, 12);
  auto parts = split(data.size());
  Engine e0(config()), e1(config());
  RegionWriter w0(e0, path, "", true, data.size());
  RegionWriter w1(e1, path, w0.tmp_path(), false, 0);
  if (!w1.direct()) SKIP("this filesystem refuses O_DIRECT at open");
  fault::arm(rule(Op::Write, 1, EINVAL));
  for (const Region& g : parts[1]) w1.write_at(data.data() + g.off, g.len, g.off);
  CHECK_EQ(fault::fired(), 1u);
  fault::clear();
  RegionStats st = w1.finish();
  CHECK(!st.direct);
  CHECK_EQ(st.fallback, std::string("write(O_DIRECT): EINVAL"));
  CHECK_EQ(st.direct_requests, 0u);
  for (const Region& g : parts[2]) w0.write_at(data.data() + g.off, g.len, g.off);
  for (const Region& g : parts[0]) w0.write_at(data.data() + g.off, g.len, g.off);
  w0.commit();
  CHECK_BYTES(read_file(path), data);
  CHECK_NO_TEMP_FILES(dir.path());
}

// A rank's write fails: it throws an IoError naming the operation, the
// temporary file, the offset and the user's target; the creator's abort
// removes the temporary file and the previous file stays.
static void share_fault(const fault::Rule& rule, const char* op, int err) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  const std::string old = random_bytes(5000, 9);
  write_file_plain(path, old);
  const std::string data = random_bytes(4096 + 40960 * 3 + 4096 * 20 + 1000, 10);
  auto parts = split(data.size());
  Engine e0(config()), e1(config());
  for (Engine* e : {&e0, &e1}) e->lease();
  const size_t fds = count_fds();
  {
    RegionWriter w0(e0, path, "", true, data.size());
    RegionWriter w1(e1, path, w0.tmp_path(), false, 0);
    fault::arm(rule);
    const Region g = parts[1][0];
    IoError e = CHECK_THROWS(IoError, ([&] {
      // An asynchronous write's failure surfaces at the latest when finish() reaps it.
      w1.write_at(data.data() + g.off, g.len, g.off);
      w1.finish();
    })());
    CHECK(fault::fired() >= 1);
    fault::clear();
    CHECK_EQ(e.err(), err);
    CHECK_EQ(e.op(), std::string(op));
    CHECK_EQ(e.target(), path);
    CHECK_CONTAINS(std::string(e.what()), " (saving " + path + ")");
    CHECK_CONTAINS(e.path(), ".fastckpt-tmp.");
    CHECK_POOL_FULL(e1);
    // The non-owner's failure leaves the file to the owner, which aborts.
    CHECK_EQ(temp_files(dir.path()).size(), 1u);
    w0.abort();
  }
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_BYTES(read_file(path), old);
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(e0);
}

TEST(write_fault_in_a_share, ALL) { share_fault(rule(Op::Write, 2, EIO), "pwrite", EIO); }

TEST(enospc_in_a_share, ALL) { share_fault(rule(Op::Write, 1, ENOSPC), "pwrite", ENOSPC); }

TEST(fdatasync_fault_in_a_share, ALL) { share_fault(rule(Op::Fsync, 1, EIO), "fdatasync", EIO); }

// The owner's rename fails: the temporary file is removed, the previous file stays.
TEST(rename_fault_in_commit, ONCE) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  write_file_plain(path, "old");
  Engine e0(config());
  const std::string data = random_bytes(10000, 11);
  {
    RegionWriter w0(e0, path, "", true, data.size());
    w0.write_at(data.data(), data.size(), 0);
    fault::arm(rule(Op::Rename, 1, EXDEV));
    IoError e = CHECK_THROWS(IoError, w0.commit());
    fault::clear();
    CHECK_EQ(e.err(), EXDEV);
    CHECK_EQ(e.target(), path);
  }
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_BYTES(read_file(path), std::string("old"));
  CHECK_POOL_FULL(e0);
}

TEST(misuse, ONCE) {
  TempDir dir;
  const std::string path = dir.file("ckpt.pt");
  Engine e0(config());
  // A temporary file that does not exist: open fails with ENOENT, naming it.
  IoError e = CHECK_THROWS(IoError, RegionWriter(e0, path, dir.file(".ckpt.pt.fastckpt-tmp.gone"), false, 0));
  CHECK_EQ(e.err(), ENOENT);
  CHECK_EQ(e.target(), path);
  RegionWriter w0(e0, path, "", true, 100);
  RegionWriter w1(e0, path, w0.tmp_path(), false, 0);
  CHECK_THROWS(UsageError, w1.commit());  // only the creator renames
  w1.finish();
  CHECK_THROWS(UsageError, w1.write_at("x", 1, 0));
  w0.abort();
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(e0);
}

FCT_MAIN()
