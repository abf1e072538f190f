// fastckpt::sys::rename_exchange: the atomic swap of two directories that every
// directory commit uses (renameat2 RENAME_EXCHANGE). It swaps, reports a
// filesystem that does not offer it as false (the caller's fallback), and
// raises any other failure as an IoError naming both paths.
#include <sys/stat.h>

#include "util.h"

using namespace fct;
using fault::Op;

namespace {

void make_dir_with(const std::string& dir, const std::string& name, const std::string& data) {
  CHECK_EQ(::mkdir(dir.c_str(), 0755), 0);
  write_file_plain(dir + "/" + name, data);
}

}  // namespace

TEST(exchange_swaps_two_directories, ONCE) {
  TempDir d;
  const std::string a = d.file("a"), b = d.file("b");
  make_dir_with(a, "new", "N");
  make_dir_with(b, "old", "O");
  if (!fastckpt::sys::rename_exchange(a, b)) SKIP("this kernel or filesystem does not offer renameat2(RENAME_EXCHANGE)");
  CHECK_BYTES(read_file(b + "/new"), std::string("N"));
  CHECK_BYTES(read_file(a + "/old"), std::string("O"));
  CHECK(!exists(b + "/old"));
}

TEST(refusal_is_false_not_an_error, ONCE) {
  TempDir d;
  const std::string a = d.file("a"), b = d.file("b");
  make_dir_with(a, "new", "N");
  make_dir_with(b, "old", "O");
  for (int err : {EINVAL, ENOSYS, EOPNOTSUPP}) {
    fault::arm(rule(Op::Rename, 1, err));
    CHECK(!fastckpt::sys::rename_exchange(a, b));
    CHECK_EQ(fault::fired(), 1u);
    fault::clear();
    CHECK_BYTES(read_file(b + "/old"), std::string("O"));  // nothing moved
    CHECK_BYTES(read_file(a + "/new"), std::string("N"));
  }
}

TEST(other_failures_name_both_paths, ONCE) {
  TempDir d;
  const std::string a = d.file("a"), b = d.file("missing");
  make_dir_with(a, "new", "N");
  IoError e = CHECK_THROWS(IoError, fastckpt::sys::rename_exchange(a, b));  // ENOENT: b does not exist
  CHECK_EQ(e.err(), ENOENT);
  CHECK_CONTAINS(std::string(e.what()), a);
  CHECK_CONTAINS(std::string(e.what()), b);
  fault::arm(rule(Op::Rename, 1, EIO));
  e = CHECK_THROWS(IoError, fastckpt::sys::rename_exchange(a, b));
  fault::clear();
  CHECK_EQ(e.err(), EIO);
  CHECK_CONTAINS(std::string(e.what()), "renameat2(RENAME_EXCHANGE)");
  CHECK(exists(a + "/new"));
}

FCT_MAIN()
