// A tiny header-only test harness (no external framework).
//
//   TEST(name, VARIANTS) { CHECK(...); CHECK_EQ(a, b); auto e = CHECK_THROWS(IoError, f()); }
//   FCT_MAIN()
//
// VARIANTS is read by tests/cpp/CMakeLists.txt, which registers one ctest
// entry per test and variant ("ALL": every backend/direct variant, "DIRECT":
// the O_DIRECT variants, "ONCE": one run without variant arguments); the
// harness itself ignores it.
//
// A failed CHECK prints file:line and what differed, and ends that test.
// SKIP("reason") ends a test as skipped: an unsupported environment is a skip
// with a printed reason, never a pass. EXPECT_FAILURE("reason") marks a test
// as a known failure (a known bug): it then passes when it fails, and fails
// when it passes, so that the mark is removed once the bug is fixed.
//
// Command line: [--list] [--only NAME] [--key=value ...] [substring]
// Exit status: 0 all passed, 1 a test failed, 77 every selected test skipped.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fct {

struct TestCase {
  const char* name;
  void (*fn)();
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> r;
  return r;
}

struct Registrar {
  Registrar(const char* name, void (*fn)()) { registry().push_back(TestCase{name, fn}); }
};

// Thrown by a failed check. Deliberately not a std::exception, so that a
// test's own catch (const std::exception&) never swallows it.
struct Failure {};
struct Skipped {
  std::string reason;
};

struct State {
  std::string current;
  std::string xfail_reason;
  std::map<std::string, std::string> options;
  std::vector<std::function<void()>> before_each, after_each;
};

inline State& state() {
  static State s;
  return s;
}

// --key=value options of the command line ("" when absent).
inline std::string option(const std::string& key, const std::string& dflt = "") {
  auto it = state().options.find(key);
  return it == state().options.end() ? dflt : it->second;
}

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED in %s: %s\n", file, line, state().current.c_str(), what.c_str());
  std::fflush(stderr);
  throw Failure{};
}

[[noreturn]] inline void skip(const std::string& reason) { throw Skipped{reason}; }

inline void expect_failure(const std::string& reason) { state().xfail_reason = reason; }

// Printing of checked values: anything with operator<<, else a placeholder.
template <class T, class = void>
struct Printable : std::false_type {};
template <class T>
struct Printable<T, decltype(void(std::declval<std::ostream&>() << std::declval<const T&>()))> : std::true_type {};

template <class T>
std::string show(const T& v) {
  if constexpr (std::is_same<T, bool>::value) {
    return v ? "true" : "false";
  } else if constexpr (std::is_convertible<T, std::string>::value) {
    return "\"" + std::string(v) + "\"";
  } else if constexpr (Printable<T>::value) {
    std::ostringstream os;
    os << v;
    return os.str();
  } else {
    return "<unprintable>";
  }
}

template <class A, class B>
void check_eq(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  if (a == b) return;
  fail(file, line, std::string("CHECK_EQ(") + ea + ", " + eb + "): " + show(a) + " != " + show(b));
}

template <class A, class B>
void check_ne(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  if (!(a == b)) return;
  fail(file, line, std::string("CHECK_NE(") + ea + ", " + eb + "): both are " + show(a));
}

inline void check_contains(const std::string& hay, const std::string& needle, const char* eh, const char* file,
                           int line) {
  if (hay.find(needle) != std::string::npos) return;
  fail(file, line, std::string("CHECK_CONTAINS(") + eh + "): \"" + hay + "\" does not contain \"" + needle + "\"");
}

inline std::string describe_current_exception() {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string("std::exception: ") + e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

// Runs f, which must throw E; returns the caught exception for further checks.
template <class E, class F>
E expect_throw(F&& f, const char* expr, const char* type, const char* file, int line) {
  try {
    f();
  } catch (const E& e) {
    return e;
  } catch (const Failure&) {
    throw;
  } catch (const Skipped&) {
    throw;
  } catch (...) {
    fail(file, line, std::string("CHECK_THROWS(") + type + ", " + expr + "): threw something else: " +
                         describe_current_exception());
  }
  fail(file, line, std::string("CHECK_THROWS(") + type + ", " + expr + "): did not throw");
}

inline int run_main(int argc, char** argv) {
  State& st = state();
  std::string only, filter;
  bool list = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--list") {
      list = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (a.rfind("--", 0) == 0) {
      size_t eq = a.find('=');
      if (eq == std::string::npos) st.options[a.substr(2)] = "1";
      else st.options[a.substr(2, eq - 2)] = a.substr(eq + 1);
    } else {
      filter = a;
    }
  }
  if (list) {
    for (const TestCase& t : registry()) std::printf("%s\n", t.name);
    return 0;
  }
  int passed = 0, failed = 0, skipped = 0, selected = 0;
  std::vector<std::string> failures;
  for (const TestCase& t : registry()) {
    if (!only.empty() && only != t.name) continue;
    if (!filter.empty() && std::strstr(t.name, filter.c_str()) == nullptr) continue;
    ++selected;
    st.current = t.name;
    st.xfail_reason.clear();
    std::printf("[ RUN  ] %s\n", t.name);
    std::fflush(stdout);
    enum { Pass, Fail, Skip } outcome = Pass;
    std::string skip_reason;
    try {
      for (auto& h : st.before_each) h();
      t.fn();
    } catch (const Failure&) {
      outcome = Fail;
    } catch (const Skipped& s) {
      outcome = Skip;
      skip_reason = s.reason;
    } catch (...) {
      std::fprintf(stderr, "FAILED in %s: uncaught %s\n", t.name, describe_current_exception().c_str());
      outcome = Fail;
    }
    try {
      for (auto& h : st.after_each) h();
    } catch (const Failure&) {
      outcome = Fail;
    } catch (...) {
      std::fprintf(stderr, "FAILED in %s: teardown threw %s\n", t.name, describe_current_exception().c_str());
      outcome = Fail;
    }
    if (!st.xfail_reason.empty() && outcome != Skip) {
      if (outcome == Fail) {
        std::printf("[ XFAIL] %s: failed as expected (known bug: %s)\n", t.name, st.xfail_reason.c_str());
        outcome = Pass;
      } else {
        std::printf("[ XPASS] %s: passed but is marked as a known failure (%s); remove EXPECT_FAILURE\n", t.name,
                    st.xfail_reason.c_str());
        outcome = Fail;
      }
    }
    switch (outcome) {
      case Pass:
        ++passed;
        std::printf("[  OK  ] %s\n", t.name);
        break;
      case Fail:
        ++failed;
        failures.push_back(t.name);
        std::printf("[ FAIL ] %s\n", t.name);
        break;
      case Skip:
        ++skipped;
        std::printf("[ SKIP ] %s: %s\n", t.name, skip_reason.c_str());
        break;
    }
    std::fflush(stdout);
  }
  st.current.clear();
  if (selected == 0) {
    std::fprintf(stderr, "no test matches%s%s\n", only.empty() ? "" : " --only ", only.c_str());
    return 1;
  }
  std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  for (const std::string& f : failures) std::printf("  failed: %s\n", f.c_str());
  if (failed) return 1;
  if (passed == 0) return 77;
  return 0;
}

}  // namespace fct

#define FCT_CAT2(a, b) a##b
#define FCT_CAT(a, b) FCT_CAT2(a, b)

// TEST(name, VARIANTS): see the top of this file.
#define TEST(name, variants)                                                      \
  static void FCT_CAT(fct_test_, name)();                                         \
  static const ::fct::Registrar FCT_CAT(fct_reg_, name)(#name, &FCT_CAT(fct_test_, name)); \
  static void FCT_CAT(fct_test_, name)()

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) ::fct::fail(__FILE__, __LINE__, "CHECK(" #cond ")");      \
  } while (0)
#define CHECK_MSG(cond, msg)                                                                      \
  do {                                                                                            \
    if (!(cond)) ::fct::fail(__FILE__, __LINE__, std::string("CHECK(" #cond "): ") + (msg));      \
  } while (0)
#define CHECK_EQ(a, b) ::fct::check_eq((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_NE(a, b) ::fct::check_ne((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_CONTAINS(hay, needle) ::fct::check_contains((hay), (needle), #hay, __FILE__, __LINE__)
// Evaluates to the caught exception (a copy of type E).
#define CHECK_THROWS(E, expr) ::fct::expect_throw<E>([&]() { (void)(expr); }, #expr, #E, __FILE__, __LINE__)
#define SKIP(reason) ::fct::skip(reason)
#define EXPECT_FAILURE(reason) ::fct::expect_failure(reason)

#define FCT_MAIN() \
  int main(int argc, char** argv) { return ::fct::run_main(argc, argv); }
