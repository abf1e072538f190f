// CRC-32 (zip polynomial 0xEDB88320, the checksum torch.save records: zlib's
// crc32) from each installed library, measured on this machine, and checked
// against zlib: the measurement made before choosing the engine's
// implementation ("measure before choosing"). Built by `make bench-crc`.
//
//   zlib       crc32_z                (always; Debian zlib1g)
//   isal       crc32_gzip_refl        (-DHAVE_ISAL, -lisal; Debian libisal-dev)
//   libdeflate libdeflate_crc32       (-DHAVE_LIBDEFLATE, -ldeflate; Debian libdeflate-dev)
//   zlib-ng    zng_crc32_z            (-DHAVE_ZLIBNG, -lz-ng; Debian libz-ng-dev, trixie and later)
//
// Parity first (exit 1 on any mismatch): random sizes at unaligned offsets,
// each CRC also computed in two chained pieces and through crc32_combine.
// Then GB/s (1e9 bytes/s) per buffer size, best of REPS, 1 thread, and
// "x2": the buffer split in two halves, one per thread, joined with zlib's
// crc32_combine (what the engine's threads would do).
//
// Usage: bench_crc [--reps N] [--sizes 4K,64K,256K,1M,8M,256M] [--parity-only]
// (256 KiB: the piece Writer::put copies and then checksums while it is hot;
// 8 MiB: the staging buffer; 256 MiB: memory, best of REPS passes.)
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(HAVE_ISAL)
#include <isa-l/crc.h>
#endif
#if defined(HAVE_LIBDEFLATE)
#include <libdeflate.h>
#endif
#if defined(HAVE_ZLIBNG)
#include <zlib-ng.h>
#endif

namespace {

using CrcFn = uint32_t (*)(uint32_t crc, const unsigned char* p, size_t n);

uint32_t crc_zlib(uint32_t crc, const unsigned char* p, size_t n) {
  return static_cast<uint32_t>(crc32_z(crc, p, static_cast<z_size_t>(n)));
}
#if defined(HAVE_ISAL)
// ISA-L's crc32_gzip_refl takes and returns the same running value as zlib's
// crc32 (pre/post inversion inside), but its length is a uint64_t.
uint32_t crc_isal(uint32_t crc, const unsigned char* p, size_t n) { return crc32_gzip_refl(crc, p, n); }
#endif
#if defined(HAVE_LIBDEFLATE)
uint32_t crc_libdeflate(uint32_t crc, const unsigned char* p, size_t n) { return libdeflate_crc32(crc, p, n); }
#endif
#if defined(HAVE_ZLIBNG)
uint32_t crc_zlibng(uint32_t crc, const unsigned char* p, size_t n) { return zng_crc32_z(crc, p, n); }
#endif

struct Impl {
  const char* name;
  const char* version;
  CrcFn fn;
};

std::vector<Impl> impls() {
  std::vector<Impl> v;
  v.push_back({"zlib", zlibVersion(), crc_zlib});
#if defined(HAVE_ISAL)
  v.push_back({"isal", "crc32_gzip_refl", crc_isal});
#endif
#if defined(HAVE_LIBDEFLATE)
  v.push_back({"libdeflate", LIBDEFLATE_VERSION_STRING, crc_libdeflate});
#endif
#if defined(HAVE_ZLIBNG)
  v.push_back({"zlib-ng", zlibng_version(), crc_zlibng});
#endif
  return v;
}

// CRC of [p, p+n) on two threads: the second half on a helper thread, the
// first here, then zlib's crc32_combine.
uint32_t crc_x2(CrcFn fn, const unsigned char* p, size_t n) {
  const size_t h = n / 2;
  uint32_t hi = 0;
  std::thread t([&] { hi = fn(0, p + h, n - h); });
  uint32_t lo = fn(0, p, h);
  t.join();
  return static_cast<uint32_t>(crc32_combine(lo, hi, static_cast<z_off_t>(n - h)));
}

int parity(const std::vector<Impl>& im, const unsigned char* base, size_t cap, std::mt19937_64& rng) {
  int bad = 0;
  auto report = [&](const char* name, const char* how, size_t off, size_t n, uint32_t want, uint32_t got) {
    if (bad < 20)
      std::fprintf(stderr, "MISMATCH %s (%s): offset %zu size %zu: zlib %08" PRIx32 " got %08" PRIx32 "\n", name, how,
                   off, n, want, got);
    ++bad;
  };
  std::vector<size_t> sizes = {0, 1, 2, 3, 7, 15, 16, 17, 31, 63, 64, 65, 127, 128, 255, 256, 511, 4096, 65536};
  for (int i = 0; i < 400; ++i) sizes.push_back(rng() % 4096);
  for (int i = 0; i < 200; ++i) sizes.push_back(rng() % (1u << 20));
  for (int i = 0; i < 8; ++i) sizes.push_back(rng() % (cap - 64));
  size_t checks = 0;
  for (size_t n : sizes) {
    const size_t off = rng() % 64;
    const unsigned char* p = base + off;
    const uint32_t seed = (rng() & 1) ? 0u : static_cast<uint32_t>(rng());  // a running CRC to continue from
    const uint32_t want = crc_zlib(seed, p, n);
    const size_t cut = n ? rng() % (n + 1) : 0;
    for (const Impl& x : im) {
      uint32_t got = x.fn(seed, p, n);
      if (got != want) report(x.name, "whole", off, n, want, got);
      got = x.fn(x.fn(seed, p, cut), p + cut, n - cut);
      if (got != want) report(x.name, "two chained pieces", off, n, want, got);
      if (seed == 0 && n >= 2) {
        got = crc_x2(x.fn, p, n);
        if (got != want) report(x.name, "2 threads + crc32_combine", off, n, want, got);
      }
      checks += 3;
    }
  }
  std::printf("parity: %zu checks of %zu implementation(s) against zlib on %zu random sizes (0 B to %.0f MiB) at "
              "offsets 0-63: %s\n",
              checks, im.size(), sizes.size(), cap / 1048576.0, bad ? "MISMATCHES" : "all equal");
  return bad;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

volatile uint32_t sink;

// Memory read reference: glibc's memchr for a byte the buffer does not hold
// (SIMD, reads every byte: main() leaves no zero byte in the buffer). Not a CRC; the speed a checksum pass cannot beat.
uint32_t read_only(uint32_t, const unsigned char* p, size_t n) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(std::memchr(p, 0, n)));
}

// Best GB/s over `reps` repetitions; each repetition runs the CRC over the
// buffer enough times to last >= 20 ms (once for large buffers).
double measure(const unsigned char* p, size_t n, int reps, bool two, CrcFn fn) {
  size_t iters = std::max<size_t>(1, (size_t{64} << 20) / n);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    uint32_t c = 0;
    for (size_t i = 0; i < iters; ++i) c ^= two ? crc_x2(fn, p, n) : fn(0, p, n);
    double dt = now() - t0;
    sink = c;
    best = std::max(best, static_cast<double>(n) * iters / dt / 1e9);
  }
  return best;
}

size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1048576; break;
    case 'G': case 'g': v *= 1073741824.0; break;
    default: break;
  }
  return static_cast<size_t>(v);
}

std::string human(size_t n) {
  char b[32];
  if (n >= (1u << 20)) std::snprintf(b, sizeof b, "%zu MiB", n >> 20);
  else std::snprintf(b, sizeof b, "%zu KiB", n >> 10);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  bool parity_only = false;
  std::vector<size_t> sizes = {4u << 10, 64u << 10, 256u << 10, 1u << 20, 8u << 20, 256u << 20};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sizes" && i + 1 < argc) {
      sizes.clear();
      std::string s = argv[++i];
      for (size_t b = 0; b <= s.size();) {
        size_t e = s.find(',', b);
        if (e == std::string::npos) e = s.size();
        if (e > b) sizes.push_back(parse_size(s.substr(b, e - b)));
        b = e + 1;
      }
    } else if (a == "--parity-only") {
      parity_only = true;
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--sizes 4K,64K,1M,8M,256M] [--parity-only]\n", argv[0]);
      return 2;
    }
  }
  const std::vector<Impl> im = impls();
  size_t cap = size_t{8} << 20;
  for (size_t s : sizes) cap = std::max(cap, s);
  cap += 64;
  std::vector<unsigned char> buf(cap + 64);
  std::mt19937_64 rng(12345);
  for (size_t i = 0; i < buf.size(); i += 8) {
    uint64_t r = rng();
    std::memcpy(buf.data() + i, &r, std::min<size_t>(8, buf.size() - i));
  }
  for (unsigned char& c : buf) c = c ? c : 1;  // no zero byte: read_only's memchr reads it all
  // 64-byte aligned start for the timings.
  unsigned char* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;

  std::printf("implementations:");
  for (const Impl& x : im) std::printf(" %s (%s)", x.name, x.version);
  std::printf("\n");
  if (parity(im, base, std::min(cap - 64, size_t{64} << 20), rng) != 0) return 1;
  if (parity_only) return 0;

  std::printf("\nGB/s (1e9 B/s), best of %d; x2 = two halves on 2 threads + crc32_combine\n", reps);
  std::printf("%-10s", "size");
  for (const Impl& x : im) std::printf(" %12s %12s", x.name, (std::string(x.name) + " x2").c_str());
  std::printf(" %12s\n", "read (memchr)");
  for (size_t n : sizes) {
    std::printf("%-10s", human(n).c_str());
    for (const Impl& x : im) {
      double g1 = measure(base, n, reps, false, x.fn);
      double g2 = measure(base, n, reps, true, x.fn);
      std::printf(" %12.2f %12.2f", g1, g2);
      std::fflush(stdout);
    }
    std::printf(" %12.2f\n", measure(base, n, reps, false, read_only));
  }
  return 0;
}
