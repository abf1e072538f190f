// See pickle_scan.h. Each piece names the Python it mirrors: pickletools'
// argument readers (read_*), CPython's int()/float()/codecs used by them, and
// _unpickle._walk's handlers.
#include "pickle_scan.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace fastckpt {
namespace {

// ---------------------------------------------------------------- values the walk tracks

enum Kind : uint8_t { kScalar, kGlobal, kInst, kDict, kList, kTuple, kSet, kFrozenset, kBytes, kStr };

const char* kind_name(uint8_t k) {  // _unpickle._kind
  switch (k) {
    case kScalar: return "scalar";
    case kGlobal: return "global";
    case kInst: return "constructed object";
    case kDict: return "dict";
    case kList: return "list";
    case kTuple: return "tuple";
    case kSet: return "set";
    case kFrozenset: return "frozenset";
    case kBytes: return "bytes";
    default: return "string";
  }
}

struct Node {
  int64_t count;  // clamped to the budget: only ever read through count_of, which caps it there
  int32_t depth;
  uint8_t kind;
  uint8_t tag = 0;  // the plain vocabulary's classes of globals and of what calls made (Tag)
};

// PickleVerdict::plain's bookkeeping: what a global is, what a call made.
enum Tag : uint8_t { T_NONE, T_G_ODICT, T_G_CALL, T_G_VALUE, T_ODICT, T_MADE };

// The opcodes of the plain vocabulary (PickleVerdict::plain).
bool plain_opcode(unsigned char c) {
  switch (c) {
    case 0x80:  // PROTO
    case '.': case '(': case 'c': case 'R': case 'b': case 'Q': case '}': case ']': case ')': case 't':
    case 0x85: case 0x86: case 0x87:  // TUPLE1..3
    case 's': case 'u': case 'a': case 'e':  // SETITEM(S), APPEND(S)
    case 'q': case 'r': case 'h': case 'j':  // BINPUT, LONG_BINPUT, BINGET, LONG_BINGET
    case 'J': case 'K': case 'M': case 'G': case 'N': case 0x88: case 0x89: case 0x8a:  // ints, float, None, bools, LONG1
    case 'X':  // BINUNICODE
      return true;
    default:
      return false;
  }
}

// Handlers (_unpickle._HANDLER) and argument readers (pickletools' ArgumentDescriptors).
enum Handler : uint8_t {
  H_NONE, H_MEMO, H_PUT, H_GET, H_SCAL, H_MARK, H_REDUCE, H_NEWOBJ, H_NEWOBJ_EX, H_BUILD, H_SETITEM, H_SETITEMS,
  H_EDICT, H_TUP1, H_TUP2, H_TUP3, H_STR, H_CNT, H_CNT0, H_LIST, H_TUPLE, H_DICT, H_FROZENSET, H_ELIST, H_ESET,
  H_APPEND, H_APPENDS, H_ADDITEMS, H_POP, H_POPM, H_DUP, H_GLOB, H_SGLOB, H_PERSID, H_BINPERSID, H_PROTO, H_FRAME,
  H_STOP, H_REFUSE
};
enum Reader : uint8_t {
  R_NONE, R_UINT1, R_UINT2, R_INT4, R_UINT4, R_UINT8, R_FLOAT8, R_DECSHORT, R_DECLONG, R_FLOATNL, R_STRINGNL,
  R_NOESC, R_NOESC_PAIR, R_UNICODENL, R_STRING1, R_STRING4, R_BYTES1, R_BYTES4, R_BYTES8, R_BYTEARRAY8,
  R_USTR1, R_USTR4, R_USTR8, R_LONG1, R_LONG4
};
struct Op {
  const char* name;
  Handler h;
  Reader r;
};

struct OpTable {
  Op ops[256];
  OpTable() {
    for (auto& o : ops) o = {nullptr, H_NONE, R_NONE};
    auto s = [&](unsigned char c, const char* name, Handler h, Reader r) { ops[c] = {name, h, r}; };
    s('(', "MARK", H_MARK, R_NONE);
    s('.', "STOP", H_STOP, R_NONE);
    s('0', "POP", H_POP, R_NONE);
    s('1', "POP_MARK", H_POPM, R_NONE);
    s('2', "DUP", H_DUP, R_NONE);
    s('F', "FLOAT", H_SCAL, R_FLOATNL);
    s('I', "INT", H_SCAL, R_DECSHORT);
    s('J', "BININT", H_SCAL, R_INT4);
    s('K', "BININT1", H_SCAL, R_UINT1);
    s('L', "LONG", H_CNT, R_DECLONG);
    s('M', "BININT2", H_SCAL, R_UINT2);
    s('N', "NONE", H_SCAL, R_NONE);
    s('P', "PERSID", H_PERSID, R_NOESC);
    s('Q', "BINPERSID", H_BINPERSID, R_NONE);
    s('R', "REDUCE", H_REDUCE, R_NONE);
    s('S', "STRING", H_CNT, R_STRINGNL);
    s('T', "BINSTRING", H_CNT, R_STRING4);
    s('U', "SHORT_BINSTRING", H_CNT, R_STRING1);
    s('V', "UNICODE", H_STR, R_UNICODENL);
    s('X', "BINUNICODE", H_STR, R_USTR4);
    s('a', "APPEND", H_APPEND, R_NONE);
    s('b', "BUILD", H_BUILD, R_NONE);
    s('c', "GLOBAL", H_GLOB, R_NOESC_PAIR);
    s('d', "DICT", H_DICT, R_NONE);
    s('}', "EMPTY_DICT", H_EDICT, R_NONE);
    s('e', "APPENDS", H_APPENDS, R_NONE);
    s('g', "GET", H_GET, R_DECSHORT);
    s('h', "BINGET", H_GET, R_UINT1);
    s('i', "INST", H_REFUSE, R_NOESC_PAIR);
    s('j', "LONG_BINGET", H_GET, R_UINT4);
    s('l', "LIST", H_LIST, R_NONE);
    s(']', "EMPTY_LIST", H_ELIST, R_NONE);
    s('o', "OBJ", H_REFUSE, R_NONE);
    s('p', "PUT", H_PUT, R_DECSHORT);
    s('q', "BINPUT", H_PUT, R_UINT1);
    s('r', "LONG_BINPUT", H_PUT, R_UINT4);
    s('s', "SETITEM", H_SETITEM, R_NONE);
    s('t', "TUPLE", H_TUPLE, R_NONE);
    s(')', "EMPTY_TUPLE", H_SCAL, R_NONE);
    s('u', "SETITEMS", H_SETITEMS, R_NONE);
    s('G', "BINFLOAT", H_SCAL, R_FLOAT8);
    s(0x80, "PROTO", H_PROTO, R_UINT1);
    s(0x81, "NEWOBJ", H_NEWOBJ, R_NONE);
    s(0x82, "EXT1", H_REFUSE, R_UINT1);
    s(0x83, "EXT2", H_REFUSE, R_UINT2);
    s(0x84, "EXT4", H_REFUSE, R_INT4);
    s(0x85, "TUPLE1", H_TUP1, R_NONE);
    s(0x86, "TUPLE2", H_TUP2, R_NONE);
    s(0x87, "TUPLE3", H_TUP3, R_NONE);
    s(0x88, "NEWTRUE", H_SCAL, R_NONE);
    s(0x89, "NEWFALSE", H_SCAL, R_NONE);
    s(0x8a, "LONG1", H_CNT, R_LONG1);
    s(0x8b, "LONG4", H_CNT, R_LONG4);
    s('B', "BINBYTES", H_CNT, R_BYTES4);
    s('C', "SHORT_BINBYTES", H_CNT, R_BYTES1);
    s(0x8c, "SHORT_BINUNICODE", H_STR, R_USTR1);
    s(0x8d, "BINUNICODE8", H_STR, R_USTR8);
    s(0x8e, "BINBYTES8", H_CNT, R_BYTES8);
    s(0x8f, "EMPTY_SET", H_ESET, R_NONE);
    s(0x90, "ADDITEMS", H_ADDITEMS, R_NONE);
    s(0x91, "FROZENSET", H_FROZENSET, R_NONE);
    s(0x92, "NEWOBJ_EX", H_NEWOBJ_EX, R_NONE);
    s(0x93, "STACK_GLOBAL", H_SGLOB, R_NONE);
    s(0x94, "MEMOIZE", H_MEMO, R_NONE);
    s(0x95, "FRAME", H_FRAME, R_UINT8);
    s(0x96, "BYTEARRAY8", H_CNT0, R_BYTEARRAY8);  // _CNT: a bytearray is neither bytes nor str -> 0
    s(0x97, "NEXT_BUFFER", H_REFUSE, R_NONE);
    s(0x98, "READONLY_BUFFER", H_REFUSE, R_NONE);
  }
};
const OpTable kOps;

const char* refused_op_text(const char* name) {  // _unpickle._REFUSED_OPS
  if (!std::strcmp(name, "INST")) return "INST (protocol-0 instantiation)";
  if (!std::strcmp(name, "OBJ")) return "OBJ (protocol-1 instantiation)";
  if (!std::strcmp(name, "EXT1")) return "EXT1 (extension registry)";
  if (!std::strcmp(name, "EXT2")) return "EXT2 (extension registry)";
  if (!std::strcmp(name, "EXT4")) return "EXT4 (extension registry)";
  if (!std::strcmp(name, "NEXT_BUFFER")) return "NEXT_BUFFER (out-of-band buffer)";
  return "READONLY_BUFFER (out-of-band buffer)";
}

// ---------------------------------------------------------------- Python's parsers, as genops uses them

bool py_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
int hex_val(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// repr() of a bytes object, for messages.
std::string bytes_repr(const char* p, size_t n) {
  bool sq = std::memchr(p, '\'', n) != nullptr, dq = std::memchr(p, '"', n) != nullptr;
  char q = (sq && !dq) ? '"' : '\'';
  std::string out = "b";
  out += q;
  const size_t shown = std::min<size_t>(n, 200);
  for (size_t i = 0; i < shown; ++i) {
    unsigned char c = static_cast<unsigned char>(p[i]);
    if (c == static_cast<unsigned char>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c >= 0x7f) {
      static const char* hx = "0123456789abcdef";
      out += "\\x";
      out += hx[c >> 4];
      out += hx[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += q;
  if (shown < n) out += "...";
  return out;
}

// int(bytes) in base 10 (PyLong_FromString): whitespace, a sign, digits with
// single underscores between them, whitespace. On success: `neg` and the
// digits without underscores or leading zeros ("0" for zero).
bool py_int(const char* p, size_t n, int64_t max_digits, bool& neg, std::string& digits, std::string& err) {
  size_t i = 0, e = n;
  while (i < e && py_space(static_cast<unsigned char>(p[i]))) ++i;
  while (e > i && py_space(static_cast<unsigned char>(p[e - 1]))) --e;
  neg = false;
  if (i < e && (p[i] == '+' || p[i] == '-')) neg = p[i++] == '-';
  digits.clear();
  bool ok = i < e && is_digit(static_cast<unsigned char>(p[i]));
  size_t count = 0;
  for (size_t k = i; ok && k < e; ++k) {
    unsigned char c = static_cast<unsigned char>(p[k]);
    if (is_digit(c)) {
      ++count;
      if (!(digits.empty() && c == '0')) digits += static_cast<char>(c);
    } else if (c == '_' && k + 1 < e && is_digit(static_cast<unsigned char>(p[k + 1]))) {
      // an underscore between digits (the one before is a digit: k > i and no "__" reaches here)
    } else {
      ok = false;
    }
  }
  if (!ok) {
    err = "invalid literal for int() with base 10: " + bytes_repr(p, n);
    return false;
  }
  if (max_digits > 0 && count > 640 && count > static_cast<uint64_t>(max_digits)) {
    err = "Exceeds the limit (" + std::to_string(max_digits) + " digits) for integer string conversion: value has " +
          std::to_string(count) + " digits; use sys.set_int_max_str_digits() to increase the limit";
    return false;
  }
  if (digits.empty()) {
    digits = "0";
    neg = false;
  }
  return true;
}

// int.bit_length() of a decimal number.
uint64_t decimal_bit_length(const std::string& digits) {
  std::vector<uint32_t> limbs;  // little-endian, base 2^32
  size_t i = 0;
  while (i < digits.size()) {
    size_t take = std::min<size_t>(9, digits.size() - i);
    uint64_t mul = 1, add = 0;
    for (size_t k = 0; k < take; ++k) {
      mul *= 10;
      add = add * 10 + static_cast<uint64_t>(digits[i + k] - '0');
    }
    i += take;
    uint64_t carry = add;
    for (auto& l : limbs) {
      uint64_t v = static_cast<uint64_t>(l) * mul + carry;
      l = static_cast<uint32_t>(v);
      carry = v >> 32;
    }
    if (carry) limbs.push_back(static_cast<uint32_t>(carry));
  }
  while (!limbs.empty() && limbs.back() == 0) limbs.pop_back();
  if (limbs.empty()) return 0;
  return 32 * (limbs.size() - 1) + (32 - __builtin_clz(limbs.back()));
}

// int.bit_length() of pickle.decode_long(data): little-endian two's complement.
uint64_t long_bit_length(const unsigned char* p, size_t n) {
  if (n == 0) return 0;
  const bool neg = p[n - 1] & 0x80;
  // magnitude: for a negative value, ~v + 1 (bytes inverted, plus one)
  size_t hi = n;
  auto byte = [&](size_t i) -> unsigned { return neg ? static_cast<unsigned char>(~p[i]) : p[i]; };
  while (hi > 0 && byte(hi - 1) == 0) --hi;
  if (!neg) return hi == 0 ? 0 : 8 * (hi - 1) + (32 - __builtin_clz(byte(hi - 1)));
  // ~v = m (non-negative, `hi` significant bytes); |v| = m + 1
  if (hi == 0) return 1;  // v = -1
  uint64_t bl = 8 * (hi - 1) + (32 - __builtin_clz(byte(hi - 1)));
  // m + 1 carries into a new bit only when m is all ones in its bl bits
  bool all_ones = true;
  for (size_t i = 0; i + 1 < hi && all_ones; ++i) all_ones = byte(i) == 0xff;
  if (all_ones) {
    unsigned top = byte(hi - 1);
    all_ones = (top & (top + 1)) == 0;
  }
  return all_ones ? bl + 1 : bl;
}

bool ieq(const char* p, size_t n, const char* w) {
  if (std::strlen(w) != n) return false;
  for (size_t i = 0; i < n; ++i)
    if ((p[i] | 0x20) != w[i]) return false;
  return true;
}

// float(bytes): underscores only between digits, whitespace stripped, then a
// decimal literal, inf, infinity or nan (any case) with an optional sign.
bool py_float(const char* p, size_t n, std::string& err) {
  err = "could not convert string to float: " + bytes_repr(p, n);
  std::string s;
  if (std::memchr(p, '_', n)) {
    char prev = 0;
    for (size_t k = 0; k < n; ++k) {
      char c = p[k];
      if (c == '_') {
        if (!is_digit(static_cast<unsigned char>(prev))) return false;
      } else {
        s += c;
        if (prev == '_' && !is_digit(static_cast<unsigned char>(c))) return false;
      }
      prev = c;
    }
    if (prev == '_') return false;
  } else {
    s.assign(p, n);
  }
  size_t i = 0, e = s.size();
  while (i < e && py_space(static_cast<unsigned char>(s[i]))) ++i;
  while (e > i && py_space(static_cast<unsigned char>(s[e - 1]))) --e;
  if (i < e && (s[i] == '+' || s[i] == '-')) ++i;
  if (i >= e) return false;
  const char* q = s.data() + i;
  const size_t m = e - i;
  if (ieq(q, m, "inf") || ieq(q, m, "infinity") || ieq(q, m, "nan")) return true;
  size_t k = i, mant = 0;
  while (k < e && is_digit(static_cast<unsigned char>(s[k]))) ++k, ++mant;
  if (k < e && s[k] == '.') {
    ++k;
    while (k < e && is_digit(static_cast<unsigned char>(s[k]))) ++k, ++mant;
  }
  if (mant == 0) return false;
  if (k < e && (s[k] == 'e' || s[k] == 'E')) {
    ++k;
    if (k < e && (s[k] == '+' || s[k] == '-')) ++k;
    size_t ed = 0;
    while (k < e && is_digit(static_cast<unsigned char>(s[k]))) ++k, ++ed;
    if (ed == 0) return false;
  }
  return k == e;
}

// codecs.escape_decode(data)[0].decode("ascii"): its length, or an error.
bool escape_decode_ascii(const char* p, size_t n, uint64_t& len, std::string& err) {
  len = 0;
  size_t i = 0;
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(p[i]);
    if (c != '\\') {
      if (c >= 0x80) {
        err = "'ascii' codec can't decode byte: ordinal not in range(128)";
        return false;
      }
      ++len, ++i;
      continue;
    }
    ++i;
    if (i == n) {
      err = "Trailing \\ in string";
      return false;
    }
    c = static_cast<unsigned char>(p[i++]);
    switch (c) {
      case '\n': break;
      case '\\': case '\'': case '"': case 'b': case 'f': case 't': case 'n': case 'r': case 'v': case 'a':
        ++len;
        break;
      case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
        unsigned v = c - '0';
        for (int k = 0; k < 2 && i < n && p[i] >= '0' && p[i] <= '7'; ++k) v = v * 8 + (p[i++] - '0');
        if ((v & 0xff) >= 0x80) {
          err = "'ascii' codec can't decode byte: ordinal not in range(128)";
          return false;
        }
        ++len;
        break;
      }
      case 'x': {
        int a = i + 1 < n ? hex_val(static_cast<unsigned char>(p[i])) : -1;
        int b = i + 1 < n ? hex_val(static_cast<unsigned char>(p[i + 1])) : -1;
        if (a < 0 || b < 0) {
          err = "invalid \\x escape at position " + std::to_string(i - 2);
          return false;
        }
        if (a >= 8) {
          err = "'ascii' codec can't decode byte: ordinal not in range(128)";
          return false;
        }
        i += 2;
        ++len;
        break;
      }
      default:  // kept as is: the backslash, then the character read again
        ++len;
        --i;
        break;
    }
  }
  return true;
}

// str(data, "raw-unicode-escape"): its length in code points, or an error.
bool raw_unicode_escape_len(const char* p, size_t n, uint64_t& len, std::string& err) {
  len = 0;
  size_t i = 0;
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(p[i++]);
    if (c != '\\' || i >= n) {
      ++len;
      continue;
    }
    c = static_cast<unsigned char>(p[i++]);
    if (c != 'u' && c != 'U') {
      len += 2;
      continue;
    }
    int count = c == 'u' ? 4 : 8;
    uint32_t v = 0;
    for (; count; --count, ++i) {
      int h = i < n ? hex_val(static_cast<unsigned char>(p[i])) : -1;
      if (h < 0) {
        err = std::string("'rawunicodeescape' codec can't decode bytes: truncated ") +
              (c == 'u' ? "\\uXXXX" : "\\UXXXXXXXX") + " escape";
        return false;
      }
      v = v * 16 + static_cast<uint32_t>(h);
    }
    if (v > 0x10FFFF) {
      err = "'rawunicodeescape' codec can't decode bytes: \\Uxxxxxxxx out of range";
      return false;
    }
    ++len;
  }
  return true;
}

// str(data, "utf-8", "surrogatepass"): its length in code points, or an error.
bool utf8_len(const unsigned char* p, size_t n, uint64_t& len, std::string& err) {
  len = 0;
  size_t i = 0;
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i, ++len;
      continue;
    }
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;  // surrogates (0xED 0xA0..0xBF) pass
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      err = "'utf-8' codec can't decode byte in position " + std::to_string(i) + ": invalid start byte";
      return false;
    }
    for (size_t k = 1; k <= need; ++k) {
      unsigned char d = i + k < n ? p[i + k] : 0;
      unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
      if (i + k >= n || d < l || d > h) {
        err = "'utf-8' codec can't decode bytes in position " + std::to_string(i) + ": invalid continuation byte";
        return false;
      }
    }
    i += need + 1;
    ++len;
  }
  return true;
}

// ---------------------------------------------------------------- the walk

struct Stop {};  // thrown to end the walk with the verdict already set

class Walk {
 public:
  Walk(const char* data, size_t n, bool persistent, int64_t max_depth, uint64_t max_ratio, uint64_t min_budget,
       int64_t max_digits, bool call_objects)
      : d_(reinterpret_cast<const unsigned char*>(data)),
        n_(n),
        persistent_(persistent),
        call_objects_(call_objects),
        max_depth_(max_depth),
        max_ratio_(max_ratio),
        max_digits_(max_digits) {
    unsigned __int128 b = static_cast<unsigned __int128>(max_ratio) * n;
    if (b < min_budget) b = min_budget;
    budget_ = b > kCap ? kCap : static_cast<uint64_t>(b);
    nodes_.push_back({0, 0, kScalar, T_NONE});  // node 0: the shared scalar
  }

  PickleVerdict run() {
    try {
      loop();
    } catch (const Stop&) {
    }
    return std::move(v_);
  }

 private:
  static constexpr uint64_t kCap = uint64_t(1) << 62;
  const unsigned char* d_;
  size_t n_;
  size_t p_ = 0;
  bool persistent_;
  bool call_objects_;  // a call may call what a call returned (torch's unpickler judges it)
  int64_t max_depth_;
  uint64_t max_ratio_;
  int64_t max_digits_;
  uint64_t budget_;
  uint64_t cost_ = 0;
  std::vector<Node> nodes_;
  std::vector<uint32_t> stack_, memo_;
  std::vector<size_t> marks_;
  size_t fence_ = 0;
  PickleVerdict v_;
  uint64_t pos_ = 0;
  bool plain_ = true;  // PickleVerdict::plain so far

  // The argument genops read.
  uint64_t au_ = 0;        // integers; lengths of strings and bytes
  int64_t ai_ = 0;         // signed ints
  bool adec_bool_ = false; // decimalnl_short: "00"/"01" (False/True)
  bool adec_neg_ = false;
  std::string adec_;       // decimalnl digits

  [[noreturn]] void fail(PickleVerdict::Kind k, std::string msg, uint64_t pos) {
    v_.kind = k;
    v_.message = std::move(msg);
    v_.pos = pos;
    throw Stop();
  }
  [[noreturn]] void bad(std::string msg) { fail(PickleVerdict::kBad, std::move(msg), pos_); }
  [[noreturn]] void refused(std::string msg) { fail(PickleVerdict::kRefused, std::move(msg), pos_); }
  [[noreturn]] void damaged(std::string msg) { fail(PickleVerdict::kDamaged, std::move(msg), 0); }

  void add_cost(uint64_t c) {
    cost_ += c;
    if (cost_ > kCap) cost_ = kCap;
  }
  static uint64_t mul(uint64_t a, uint64_t b) {
    unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
    return r > kCap ? kCap : static_cast<uint64_t>(r);
  }
  int64_t count_of(uint32_t x) const {
    int64_t c = nodes_[x].count;
    return c < static_cast<int64_t>(budget_) ? c : static_cast<int64_t>(budget_);
  }
  void set_count(Node& node, int64_t c) {
    node.count = c < static_cast<int64_t>(budget_) ? c : static_cast<int64_t>(budget_);
  }
  uint32_t new_node(uint8_t kind, int64_t count, int32_t depth) {
    if (nodes_.size() >= UINT32_MAX) bad("more than " + std::to_string(UINT32_MAX) + " values");
    Node node{0, depth, kind, T_NONE};
    set_count(node, count);
    nodes_.push_back(node);
    return static_cast<uint32_t>(nodes_.size() - 1);
  }

  // --- pickletools' readers
  void need(size_t k, const char* what) {
    if (n_ - p_ < k) {
      p_ = n_;
      damaged(std::string("not enough data in stream to read ") + what);
    }
  }
  uint64_t le(size_t k) {
    uint64_t v = 0;
    for (size_t i = 0; i < k; ++i) v |= static_cast<uint64_t>(d_[p_ + i]) << (8 * i);
    p_ += k;
    return v;
  }
  // readline(): the line without its newline
  void line(const char*& s, size_t& len, const char* what) {
    const void* nl = std::memchr(d_ + p_, '\n', n_ - p_);
    if (!nl) {
      p_ = n_;
      damaged(std::string("no newline found when trying to read ") + what);
    }
    s = reinterpret_cast<const char*>(d_ + p_);
    len = static_cast<const unsigned char*>(nl) - (d_ + p_);
    p_ += len + 1;
  }
  void counted(uint64_t k, const char* what) {  // f.read(k) must give k bytes
    if (k > n_ - p_) {
      uint64_t have = n_ - p_;
      p_ = n_;
      damaged("expected " + std::to_string(k) + " bytes in a " + what + ", but only " + std::to_string(have) +
              " remain");
    }
    p_ += k;
  }
  void noescape() {
    const char* s;
    size_t len;
    line(s, len, "stringnl");
    uint64_t l;
    std::string err;
    if (!escape_decode_ascii(s, len, l, err)) damaged(err);
  }
  void decimal(bool long_form) {
    const char* s;
    size_t len;
    line(s, len, "stringnl");
    adec_bool_ = false;
    if (!long_form && len == 2 && s[0] == '0' && (s[1] == '0' || s[1] == '1')) {
      adec_bool_ = true;
      adec_neg_ = false;
      adec_ = s[1] == '1' ? "1" : "0";
      return;
    }
    if (long_form && len && s[len - 1] == 'L') --len;
    std::string err;
    if (!py_int(s, len, max_digits_, adec_neg_, adec_, err)) damaged(err);
  }

  void read_arg(Reader r) {
    std::string err;
    switch (r) {
      case R_NONE: return;
      case R_UINT1: need(1, "uint1"); au_ = le(1); return;
      case R_UINT2: need(2, "uint2"); au_ = le(2); return;
      case R_INT4: need(4, "int4"); ai_ = static_cast<int32_t>(le(4)); return;
      case R_UINT4: need(4, "uint4"); au_ = le(4); return;
      case R_UINT8: need(8, "uint8"); au_ = le(8); return;
      case R_FLOAT8: need(8, "float8"); p_ += 8; return;
      case R_DECSHORT: decimal(false); return;
      case R_DECLONG: decimal(true); return;
      case R_FLOATNL: {
        const char* s;
        size_t len;
        line(s, len, "stringnl");
        if (!py_float(s, len, err)) damaged(err);
        return;
      }
      case R_STRINGNL: {
        const char* s;
        size_t len;
        line(s, len, "stringnl");
        if (len && (s[0] == '"' || s[0] == '\'')) {
          if (s[len - 1] != s[0] || len < 1) {
            damaged(std::string("strinq quote ") + (s[0] == '"' ? "b'\"'" : "b\"'\"") +
                    " not found at both ends of " + bytes_repr(s, len));
          }
          // data[1:-1] (empty for a lone quote)
          if (len >= 2) {
            s += 1;
            len -= 2;
          } else {
            len = 0;
          }
        } else {
          damaged("no string quotes around " + bytes_repr(s, len));
        }
        if (!escape_decode_ascii(s, len, au_, err)) damaged(err);
        return;
      }
      case R_NOESC: noescape(); return;
      case R_NOESC_PAIR: noescape(); noescape(); return;
      case R_UNICODENL: {
        const char* s;
        size_t len;
        line(s, len, "unicodestringnl");
        if (!raw_unicode_escape_len(s, len, au_, err)) damaged(err);
        return;
      }
      case R_STRING1: need(1, "uint1"); au_ = le(1); counted(au_, "string1"); return;
      case R_STRING4: {
        need(4, "int4");
        int64_t k = static_cast<int32_t>(le(4));
        if (k < 0) damaged("string4 byte count < 0: " + std::to_string(k));
        au_ = static_cast<uint64_t>(k);
        counted(au_, "string4");
        return;
      }
      case R_BYTES1: need(1, "uint1"); au_ = le(1); counted(au_, "bytes1"); return;
      case R_BYTES4: need(4, "uint4"); au_ = le(4); counted(au_, "bytes4"); return;
      case R_BYTES8:
      case R_BYTEARRAY8: {
        const char* what = r == R_BYTES8 ? "bytes8" : "bytearray8";
        need(8, "uint8");
        au_ = le(8);
        if (au_ > static_cast<uint64_t>(INT64_MAX)) damaged(std::string(what) + " byte count > sys.maxsize: " +
                                                             std::to_string(au_));
        counted(au_, what);
        return;
      }
      case R_USTR1:
      case R_USTR4:
      case R_USTR8: {
        const char* what = r == R_USTR1 ? "unicodestring1" : r == R_USTR4 ? "unicodestring4" : "unicodestring8";
        size_t w = r == R_USTR1 ? 1 : r == R_USTR4 ? 4 : 8;
        need(w, w == 1 ? "uint1" : w == 4 ? "uint4" : "uint8");
        uint64_t k = le(w);
        if (w == 8 && k > static_cast<uint64_t>(INT64_MAX))
          damaged("unicodestring8 byte count > sys.maxsize: " + std::to_string(k));
        size_t at = p_;
        counted(k, what);
        if (!utf8_len(d_ + at, k, au_, err)) damaged(err);
        return;
      }
      case R_LONG1:
      case R_LONG4: {
        int64_t k;
        if (r == R_LONG1) {
          need(1, "uint1");
          k = static_cast<int64_t>(le(1));
        } else {
          need(4, "int4");
          k = static_cast<int32_t>(le(4));
          if (k < 0) damaged("long4 byte count < 0: " + std::to_string(k));
        }
        if (static_cast<uint64_t>(k) > n_ - p_) {
          p_ = n_;
          damaged(std::string("not enough data in stream to read ") + (r == R_LONG1 ? "long1" : "long4"));
        }
        au_ = long_bit_length(d_ + p_, static_cast<size_t>(k)) / 8;
        p_ += static_cast<size_t>(k);
        return;
      }
    }
  }

  // --- _walk's helpers
  uint32_t pop() {
    if (stack_.size() <= fence_) bad("stack underflow");
    uint32_t x = stack_.back();
    stack_.pop_back();
    return x;
  }
  // pop_mark: the items above the last MARK are stack_[fence_, end); the caller
  // uses them, then drop_mark() removes them with the MARK.
  size_t mark_begin() {
    if (marks_.empty()) bad("no MARK to pop to");
    return fence_;
  }
  void drop_mark(size_t begin) {
    stack_.resize(begin);
    marks_.pop_back();
    fence_ = marks_.empty() ? 0 : marks_.back();
  }
  // nest(node, items): items are stack_[b, e) or the single value `one`
  void nest(uint32_t node, const uint32_t* items, size_t count) {
    int32_t m = 0;
    for (size_t i = 0; i < count; ++i) m = std::max(m, nodes_[items[i]].depth);
    int64_t dd = 1 + static_cast<int64_t>(m);
    if (dd > nodes_[node].depth) {
      if (dd > max_depth_) bad("containers nested more than " + std::to_string(max_depth_) + " deep");
      nodes_[node].depth = static_cast<int32_t>(dd);
    }
  }
  uint32_t target(uint8_t k1, int k2, const char* op, const char* allowed) {
    if (stack_.size() <= fence_) bad(std::string(op) + " without an object to add to");
    uint32_t t = stack_.back();
    uint8_t k = nodes_[t].kind;
    if (!(k == k1 || (k2 >= 0 && k == k2)))
      refused(std::string(op) + " on a " + kind_name(k) + " (only " + allowed + " allowed)");
    return t;
  }
  std::string memo_repr() const {
    if (adec_bool_) return adec_ == "1" ? "True" : "False";
    return (adec_neg_ ? "-" : "") + adec_;
  }
  // the decimal argument as a memo index (only when it fits and is >= 0)
  bool dec_index(uint64_t& idx) const {
    if (adec_neg_ || adec_.size() > 18) return false;
    idx = std::stoull(adec_);
    return true;
  }

  // The GLOBAL at pos_ (its two lines, read and checked by read_arg): its Tag in the plain
  // vocabulary; T_NONE (and plain_ false) for any other global.
  uint8_t global_tag() {
    const char* s = reinterpret_cast<const char*>(d_) + pos_ + 1;
    const char* end = reinterpret_cast<const char*>(d_) + p_;
    const char* nl = static_cast<const char*>(std::memchr(s, '\n', static_cast<size_t>(end - s)));
    if (!nl) {
      plain_ = false;
      return T_NONE;
    }
    const std::string module(s, nl);
    const char* nl2 = static_cast<const char*>(std::memchr(nl + 1, '\n', static_cast<size_t>(end - nl - 1)));
    const std::string name(nl + 1, nl2 ? nl2 : end);
    if (module == "collections" && name == "OrderedDict") return T_G_ODICT;
    if ((module == "torch._utils" &&
         (name == "_rebuild_tensor_v2" || name == "_rebuild_tensor_v3" || name == "_rebuild_parameter")) ||
        (module == "torch" && name == "Size"))
      return T_G_CALL;
    if (module == "torch" && !name.empty() &&
        std::all_of(name.begin(), name.end(), [](char ch) {
          return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
        }))
      return T_G_VALUE;  // a storage class or a dtype, by the caller's lookup in torch's allow-list
    plain_ = false;
    return T_NONE;
  }

  void budget_check(uint64_t pos) {
    if (cost_ > budget_)
      fail(PickleVerdict::kBad,
           "the objects would take more than " + std::to_string(budget_) + " bytes (" + std::to_string(max_ratio_) +
               " times the pickle's size)",
           pos);
  }

  void loop() {
    constexpr uint64_t C_SLOT = 8, C_NUM = 32, C_OBJ = 64, C_SET = 216, C_ELEM = 8, C_ENTRY = 56;
    for (;;) {
      pos_ = p_;
      if (p_ >= n_) damaged("pickle exhausted before seeing STOP");
      const unsigned char code = d_[p_++];
      const Op& op = kOps.ops[code];
      if (!op.name) {
        damaged("at position " + std::to_string(pos_) + ", opcode " + bytes_repr(reinterpret_cast<const char*>(&code), 1) +
                " unknown");
      }
      read_arg(op.r);
      if (plain_ && !plain_opcode(code)) plain_ = false;
      switch (op.h) {
        case H_MEMO:
        case H_PUT: {
          bool from_dec = op.r == R_DECSHORT;
          uint64_t idx = memo_.size();
          bool valid = true;  // idx is a non-negative value that fits
          if (op.h == H_PUT) {
            if (from_dec) valid = dec_index(idx);
            else idx = au_;
          }
          if (stack_.size() <= fence_) bad(std::string(op.name) + " with an empty stack");
          if (valid && idx == memo_.size()) {  // (True == 1 and False == 0 here too)
            memo_.push_back(stack_.back());
            add_cost(3 * C_SLOT);
          } else if (valid && !(from_dec && adec_bool_) && idx < memo_.size()) {
            memo_[idx] = stack_.back();
          } else {
            bad("memo index " + (from_dec ? memo_repr() : std::to_string(idx)) + " skips ahead of the " +
                std::to_string(memo_.size()) + " entries stored so far");
          }
          continue;
        }
        case H_GET: {
          uint64_t idx = au_;
          bool valid = true;
          if (op.r == R_DECSHORT) valid = !adec_bool_ && dec_index(idx);
          if (!valid || idx >= memo_.size())
            bad("memo index " + (op.r == R_DECSHORT ? memo_repr() : std::to_string(idx)) + " was never stored");
          stack_.push_back(memo_[idx]);
          add_cost(C_SLOT);
          continue;
        }
        case H_SCAL:
          stack_.push_back(0);
          add_cost(C_NUM);
          continue;
        case H_MARK:
          marks_.push_back(stack_.size());
          fence_ = stack_.size();
          add_cost(C_SLOT);
          break;
        case H_REDUCE:
        case H_NEWOBJ:
        case H_NEWOBJ_EX: {
          int64_t kw = -1;
          if (op.h == H_NEWOBJ_EX) kw = pop();
          uint32_t args = pop();
          uint32_t func = pop();
          const uint8_t fk = nodes_[func].kind;
          if (fk != kGlobal && !(call_objects_ && fk == kInst))
            refused(std::string(op.name) + " calls a " + kind_name(nodes_[func].kind) + ", not an allowed global");
          int64_t count = count_of(args) + (kw >= 0 ? count_of(static_cast<uint32_t>(kw)) : 0);
          int32_t depth = std::max(nodes_[args].depth, kw >= 0 ? nodes_[kw].depth : 0);
          const uint8_t ftag = nodes_[func].tag;
          if (op.h != H_REDUCE || (ftag != T_G_ODICT && ftag != T_G_CALL)) plain_ = false;
          stack_.push_back(new_node(kInst, count, depth));
          nodes_[stack_.back()].tag = ftag == T_G_ODICT ? T_ODICT : T_MADE;
          add_cost(C_OBJ + mul(C_ENTRY, static_cast<uint64_t>(count)));
          break;
        }
        case H_BUILD: {
          uint32_t state = pop();
          uint32_t t = target(kInst, -1, "BUILD", "inst");
          if (nodes_[t].tag != T_ODICT || nodes_[state].kind != kDict) plain_ = false;
          nest(t, &state, 1);
          add_cost(C_OBJ + mul(C_ENTRY, static_cast<uint64_t>(count_of(state))));
          break;
        }
        case H_SETITEM:
        case H_SETITEMS: {
          uint32_t pair[2];
          const uint32_t* items;
          size_t k, begin = 0;
          if (op.h == H_SETITEM) {
            pair[1] = pop();
            pair[0] = pop();
            items = pair;
            k = 2;
          } else {
            begin = mark_begin();
            k = stack_.size() - begin;
            if (k % 2) bad(std::string("odd number of items for ") + op.name);
            // the items leave the stack before the target is looked at
            drop_mark_keep(begin);
            items = scratch_.data();
          }
          if (k % 2) bad(std::string("odd number of items for ") + op.name);
          uint32_t t = target(kDict, kInst, op.name, "dict/inst");
          if (nodes_[t].kind != kDict && nodes_[t].tag != T_ODICT) plain_ = false;
          set_count(nodes_[t], nodes_[t].count + static_cast<int64_t>(k / 2));
          add_cost(mul(C_ENTRY, k / 2));
          nest(t, items, k);
          break;
        }
        case H_EDICT:
          stack_.push_back(new_node(kDict, 0, 1));
          add_cost(C_OBJ);
          break;
        case H_TUP1:
        case H_TUP2:
        case H_TUP3: {
          size_t k = op.h == H_TUP1 ? 1 : op.h == H_TUP2 ? 2 : 3;
          if (stack_.size() < fence_ + k) bad("stack underflow");
          size_t b = stack_.size() - k;
          int64_t count = static_cast<int64_t>(k);
          for (size_t i = b; i < stack_.size(); ++i) count += count_of(stack_[i]);
          uint32_t node = new_node(kTuple, count, 0);
          nest(node, stack_.data() + b, k);
          stack_.resize(b);
          stack_.push_back(node);
          add_cost(C_OBJ + k * C_ELEM);
          break;
        }
        case H_STR:
          stack_.push_back(new_node(kStr, static_cast<int64_t>(au_), 0));
          add_cost(C_OBJ + mul(2, au_));
          break;
        case H_CNT:
        case H_CNT0: {
          uint64_t k = op.h == H_CNT0 ? 0 : op.r == R_DECLONG ? decimal_bit_length(adec_) / 8 : au_;
          stack_.push_back(new_node(kBytes, static_cast<int64_t>(std::min<uint64_t>(k, kCap)), 0));
          add_cost(C_OBJ + k);
          break;
        }
        case H_LIST:
        case H_TUPLE:
        case H_DICT:
        case H_FROZENSET: {
          size_t begin = mark_begin();
          size_t k = stack_.size() - begin;
          uint8_t kind = op.h == H_LIST ? kList : op.h == H_TUPLE ? kTuple : op.h == H_DICT ? kDict : kFrozenset;
          drop_mark_keep(begin);
          if (kind == kDict && k % 2) bad("odd number of items for DICT");
          int64_t count = static_cast<int64_t>(k);
          if (kind == kTuple)
            for (uint32_t x : scratch_) count += count_of(x);
          uint32_t node = new_node(kind, count, 0);
          nest(node, scratch_.data(), k);
          stack_.push_back(node);
          add_cost((kind == kFrozenset ? C_SET : C_OBJ) +
                   mul(k, (kind == kList || kind == kTuple) ? C_ELEM : C_ENTRY));
          break;
        }
        case H_ELIST:
          stack_.push_back(new_node(kList, 0, 1));
          add_cost(C_OBJ);
          break;
        case H_ESET:
          stack_.push_back(new_node(kSet, 0, 1));
          add_cost(C_SET);
          break;
        case H_APPEND:
        case H_APPENDS:
        case H_ADDITEMS: {
          uint32_t one;
          const uint32_t* items;
          size_t k;
          if (op.h == H_APPEND) {
            one = pop();
            items = &one;
            k = 1;
          } else {
            size_t begin = mark_begin();
            k = stack_.size() - begin;
            drop_mark_keep(begin);
            items = scratch_.data();
          }
          uint32_t t;
          if (op.h == H_ADDITEMS) {
            t = target(kSet, kInst, op.name, "set/inst");
            add_cost(mul(C_ENTRY, k));
          } else {
            t = target(kList, -1, op.name, "list");
            add_cost(mul(2 * C_ELEM, k));
          }
          set_count(nodes_[t], nodes_[t].count + static_cast<int64_t>(k));
          nest(t, items, k);
          break;
        }
        case H_POP:
          if (!marks_.empty() && marks_.back() == stack_.size()) {
            marks_.pop_back();
            fence_ = marks_.empty() ? 0 : marks_.back();
          } else {
            pop();
          }
          break;
        case H_POPM: {
          size_t begin = mark_begin();
          drop_mark(begin);
          break;
        }
        case H_DUP: {
          uint32_t x = pop();
          stack_.push_back(x);
          stack_.push_back(x);
          add_cost(C_SLOT);
          break;
        }
        case H_GLOB:
          stack_.push_back(new_node(kGlobal, 0, 0));
          nodes_[stack_.back()].tag = plain_ ? global_tag() : T_NONE;
          add_cost(C_OBJ);
          break;
        case H_SGLOB: {
          uint32_t qual = pop();
          uint32_t module = pop();
          if (nodes_[module].kind != kStr || nodes_[qual].kind != kStr)
            bad("STACK_GLOBAL needs a module and a name string");
          stack_.push_back(new_node(kGlobal, 0, 0));
          add_cost(C_OBJ);
          break;
        }
        case H_PERSID:
        case H_BINPERSID: {
          if (!persistent_) refused("a persistent id (none are allowed here)");
          uint32_t pid = op.h == H_BINPERSID ? pop() : 0;
          stack_.push_back(new_node(kInst, 1, nodes_[pid].depth));
          add_cost(C_OBJ + mul(C_ELEM, static_cast<uint64_t>(count_of(pid))));
          break;
        }
        case H_PROTO:
          if (au_ > 5) bad("unsupported pickle protocol " + std::to_string(au_));
          if (au_ != 2) plain_ = false;  // torch's unpickler warns about other protocols
          break;
        case H_FRAME: {
          uint64_t follow = n_ - pos_ - 9;
          if (au_ > follow)
            bad("a frame of " + std::to_string(au_) + " bytes in the " + std::to_string(follow) + " bytes that follow");
          break;
        }
        case H_STOP:
          if (stack_.size() != 1 || !marks_.empty())
            bad("STOP with " + std::to_string(stack_.size()) + " objects on the stack");
          budget_check(pos_);
          budget_check(n_);
          v_.kind = PickleVerdict::kAccepted;
          v_.cost = cost_;
          v_.plain = plain_;
          return;
        case H_REFUSE:
          refused(std::string("opcode ") + refused_op_text(op.name) + " (not used by the pickles read here)");
        case H_NONE:
          refused(std::string("unknown opcode ") + op.name);
      }
      budget_check(pos_);
    }
  }

  // The items above the last MARK move to scratch_; the MARK goes.
  std::vector<uint32_t> scratch_;
  void drop_mark_keep(size_t begin) {
    scratch_.assign(stack_.begin() + static_cast<std::ptrdiff_t>(begin), stack_.end());
    drop_mark(begin);
  }
};

}  // namespace

PickleVerdict pickle_check(const char* data, size_t n, bool persistent, int64_t max_depth, uint64_t max_ratio,
                           uint64_t min_budget, int64_t int_max_str_digits, bool call_objects) {
  Walk w(data, n, persistent, max_depth, max_ratio, min_budget, int_max_str_digits, call_objects);
  return w.run();
}

}  // namespace fastckpt
