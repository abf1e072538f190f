// The C++ safety walk of a pickle (fastckpt::pickle_check, csrc/pickle/pickle_scan.cc):
// the hostile shapes it must refuse without recursing and without allocating
// more than the input accounts for: nesting a million deep, huge memo
// indices, counted sizes past the end, truncated input; and real pickles
// accepted. (Its verdicts equal the Python reference's: tests/python/formats/test_pickle_walk.py.)
#include <sys/resource.h>

#include <string>

#include "harness.h"
#include "pickle_scan.h"

using fastckpt::PickleVerdict;

namespace {

const std::string P2("\x80\x02", 2);
const std::string P4("\x80\x04", 2);

PickleVerdict walk(const std::string& s, bool persistent = true, int64_t max_depth = 1000) {
  return fastckpt::pickle_check(s.data(), s.size(), persistent, max_depth, 64, 1 << 20);
}

std::string le(uint64_t v, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

long peak_rss_kib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

}  // namespace

TEST(accepts_a_torch_save_like_pickle, ONCE) {
  // {"w": <persistent id ('storage', ..., '0', 'cpu', 4)>} at protocol 2
  using namespace std::string_literals;
  std::string s = P2 + "}q\x00X\x01\x00\x00\x00wq\x01(X\x07\x00\x00\x00storageq\x02X\x01\x00\x00\x00" "0"
                       "X\x03\x00\x00\x00" "cpuK\x04tq\x03Qs."s;
  PickleVerdict v = walk(s);
  CHECK_MSG(v.kind == PickleVerdict::kAccepted, v.message);
  CHECK(v.cost > 0);
  v = walk(s, /*persistent=*/false);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kRefused));
  CHECK_CONTAINS(v.message, "persistent id");
}

TEST(million_deep_nesting_is_refused_iteratively, ONCE) {
  const size_t depth = 1000000;
  // lists built on the stack, tuples of tuples, and marks: none may recurse
  std::string lists = P2 + std::string(depth, ']') + std::string(depth - 1, 'a') + ".";
  PickleVerdict v = walk(lists);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
  CHECK_CONTAINS(v.message, "containers nested more than 1000 deep");
  CHECK_EQ(v.pos, static_cast<uint64_t>(2 + depth + 999));  // the APPEND making depth 1001

  std::string tuples = P2 + "N" + std::string(depth, '\x85') + ".";
  v = walk(tuples);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
  CHECK_CONTAINS(v.message, "nested more than 1000 deep");

  // without a depth limit that bites, the walk still finishes (and accepts a valid deep pickle)
  v = walk(lists, true, 2000000);
  CHECK_MSG(v.kind == PickleVerdict::kAccepted, v.message);

  std::string marks = P2 + std::string(depth, '(') + ".";
  v = walk(marks);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
  CHECK_CONTAINS(v.message, "STOP with 0 objects on the stack");
}

TEST(huge_memo_indices_are_refused_without_allocating, ONCE) {
  const long before = peak_rss_kib();
  for (uint64_t idx : {uint64_t(1), uint64_t(0x2000000), uint64_t(0x7fffffff), uint64_t(0xffffffff)}) {
    PickleVerdict v = walk(P2 + "}r" + le(idx, 4) + ".");
    CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
    CHECK_EQ(v.message, "memo index " + std::to_string(idx) + " skips ahead of the 0 entries stored so far");
    CHECK_EQ(v.pos, uint64_t(3));
    v = walk(P2 + "j" + le(idx, 4) + ".");
    CHECK_EQ(v.message, "memo index " + std::to_string(idx) + " was never stored");
  }
  // text forms: a 40-digit index, a negative one, the protocol-0 booleans
  PickleVerdict v = walk("Np" + std::string(40, '9') + "\n.");
  CHECK_EQ(v.message, "memo index " + std::string(40, '9') + " skips ahead of the 0 entries stored so far");
  v = walk("Np-1\n.");
  CHECK_EQ(v.message, "memo index -1 skips ahead of the 0 entries stored so far");
  v = walk("Np0\ng01\n0.");
  CHECK_EQ(v.message, "memo index True was never stored");
  v = walk("Np00\n.");  // False == 0: stored at the next index
  CHECK_MSG(v.kind == PickleVerdict::kAccepted, v.message);
  CHECK(peak_rss_kib() - before < 64 * 1024);  // nothing sized by an index (the 64 GiB ask above)
}

TEST(counted_sizes_beyond_the_end_are_damaged, ONCE) {
  struct Case {
    std::string pkl, want;
  } cases[] = {
      {P4 + "\x8e" + le(1ull << 40, 8) + "abc.", "expected 1099511627776 bytes in a bytes8, but only 4 remain"},
      {P4 + "\x8d" + le(1ull << 40, 8) + "abc.", "expected 1099511627776 bytes in a unicodestring8, but only 4 remain"},
      {std::string("\x80\x05\x96", 3) + le(1ull << 33, 8) + "abc.",
       "expected 8589934592 bytes in a bytearray8, but only 4 remain"},
      {std::string("\x80\x03", 2) + "B" + le(0xffffffff, 4) + "abc.",
       "expected 4294967295 bytes in a bytes4, but only 4 remain"},
      {P2 + "\x8b" + le(0x7fffffff, 4) + "\x01.", "not enough data in stream to read long4"},
      {P4 + "\x8e" + le(~0ull, 8) + ".", "bytes8 byte count > sys.maxsize: 18446744073709551615"},
      {"T" + le(0xffffffff, 4) + ".", "string4 byte count < 0: -1"},
  };
  for (const auto& c : cases) {
    PickleVerdict v = walk(c.pkl);
    CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kDamaged));
    CHECK_EQ(v.message, c.want);
  }
  // FRAME: its length against the bytes that follow it
  PickleVerdict v = walk(P4 + "\x95" + le(1ull << 40, 8) + "N.");
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
  CHECK_EQ(v.message, "a frame of 1099511627776 bytes in the 2 bytes that follow");
  v = walk(P4 + "\x95" + le(2, 8) + "N.");
  CHECK_MSG(v.kind == PickleVerdict::kAccepted, v.message);
}

TEST(truncated_input_is_damaged_at_every_cut, ONCE) {
  using namespace std::string_literals;
  std::string s = P4 + "\x95"s + le(33, 8) + "}\x94(\x8c\x01w\x94\x8a\x02\xff\x7f\x8c\x01x\x94G"s + le(0, 8) +
                  "\x8c\x01s\x94]\x94(K\x01M\x00\x01" "eu."s;
  PickleVerdict full = walk(s);
  CHECK_MSG(full.kind == PickleVerdict::kAccepted, full.message);
  for (size_t cut = 0; cut < s.size(); ++cut) {
    PickleVerdict v = walk(s.substr(0, cut));
    CHECK_MSG(v.kind != PickleVerdict::kAccepted, "cut at " + std::to_string(cut));
    if (v.kind == PickleVerdict::kDamaged) {
      CHECK_MSG(v.message.find("exhausted") != std::string::npos || v.message.find("not enough") != std::string::npos ||
                    v.message.find("expected") != std::string::npos,
                "cut at " + std::to_string(cut) + ": " + v.message);
    }
  }
  CHECK_EQ(walk("").message, "pickle exhausted before seeing STOP");
}

TEST(budget_refuses_amplifiers, ONCE) {
  // EMPTY_SET spam: 216 estimated bytes per pickle byte
  std::string s = P4 + "](" + std::string(1 << 18, '\x8f') + "e.";
  PickleVerdict v = walk(s);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kBad));
  CHECK_CONTAINS(v.message, "the objects would take more than 16777600 bytes (64 times the pickle's size)");
}

TEST(calls_of_what_a_call_returned_only_with_call_objects, ONCE) {
  // {"i": Outer.Inner(3)} at protocol 2: getattr(Outer, "Inner") is called (REDUCE), its result
  // made with NEWOBJ, as pickle writes a nested class below protocol 4
  using namespace std::string_literals;
  std::string s = P2 + "}X\x01\x00\x00\x00i" "cbuiltins\ngetattr\ncm\nOuter\nX\x05\x00\x00\x00Inner\x86R)\x81}X\x01\x00\x00\x00vK\x03sbs."s;
  PickleVerdict strict = walk(s);
  CHECK_EQ(static_cast<int>(strict.kind), static_cast<int>(PickleVerdict::kRefused));
  CHECK_CONTAINS(strict.message, "NEWOBJ calls a constructed object, not an allowed global");
  PickleVerdict v = fastckpt::pickle_check(s.data(), s.size(), true, 1000, 64, 1 << 20, 4300, /*call_objects=*/true);
  CHECK_MSG(v.kind == PickleVerdict::kAccepted, v.message);
  // a container is never callable
  std::string t = P2 + "]N\x85R."s;
  v = fastckpt::pickle_check(t.data(), t.size(), true, 1000, 64, 1 << 20, 4300, true);
  CHECK_EQ(static_cast<int>(v.kind), static_cast<int>(PickleVerdict::kRefused));
  CHECK_CONTAINS(v.message, "REDUCE calls a list, not an allowed global");
}

FCT_MAIN()
