#include "crc32.h"

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>
#ifdef FASTCKPT_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FASTCKPT_CRC_FOLD_AVX2 1
#include <immintrin.h>
#endif

namespace fastckpt {

namespace {

// The build's CRC-32 (ISA-L or zlib): the short inputs, the last bytes of the wide path, and the
// whole of every input on CPUs without it.
uint32_t crc32_base(uint32_t crc, const unsigned char* p, uint64_t n) {
#ifdef FASTCKPT_HAVE_ISAL
  // Same running value as zlib's crc32 (inversions inside), 64-bit length.
  return crc32_gzip_refl(crc, p, n);
#else
  return static_cast<uint32_t>(::crc32_z(crc, p, static_cast<z_size_t>(n)));
#endif
}

#ifdef FASTCKPT_CRC_FOLD_AVX2
// Folding with carry-less multiplies, 256 bits at a time (VPCLMULQDQ on AVX2 registers). Where
// a CPU has VPCLMULQDQ but not AVX-512 (AMD Zen 3, Intel Alder Lake), ISA-L runs its 128-bit
// kernel, which one core takes at about 9-11 GB/s; this takes 16-20 GB/s (docs/ENGINE.md).
//
// The message is a polynomial over GF(2), bit-reflected. Four 256-bit accumulators hold the
// first 128 bytes (the running value, inverted, added to the first 4); each later 128 bytes are
// added after multiplying every 128-bit lane by x^1024 mod P (as its two 64-bit halves times the
// constants x^(1024+32) and x^(1024-32) mod P, reflected, shifted by one). The accumulators are
// then folded into each other (x^256), then into 128 bits (x^128), the rest 32 and 16 bytes at
// a time. What is left, 16 bytes and a tail under 16, has the same CRC with a zero start as the
// message with its start: the build's CRC-32 finishes it. tests/cpp/test_crc.cc checks it
// against zlib's at every length and alignment it tries.
__attribute__((target("avx2,vpclmulqdq,pclmul"))) uint32_t crc32_fold_avx2(uint32_t crc, const unsigned char* p,
                                                                           uint64_t n) {
  // (x^(D+32) mod P, x^(D-32) mod P), reflected and shifted left by one, for a distance of D bits.
  const __m256i k1024 = _mm256_set_epi64x(0x14a7fe880, 0x1e88ef372, 0x14a7fe880, 0x1e88ef372);
  const __m256i k256 = _mm256_set_epi64x(0x15a546366, 0x0f1da05aa, 0x15a546366, 0x0f1da05aa);
  const __m128i k128 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
#define FCK_LOAD(q) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
#define FCK_FOLD256(x, k) _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11))
#define FCK_FOLD128(x) _mm_xor_si128(_mm_clmulepi64_si128(x, k128, 0x00), _mm_clmulepi64_si128(x, k128, 0x11))
  __m256i x0 = _mm256_xor_si256(FCK_LOAD(p), _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, static_cast<int>(~crc)));
  __m256i x1 = FCK_LOAD(p + 32), x2 = FCK_LOAD(p + 64), x3 = FCK_LOAD(p + 96);
  p += 128;
  n -= 128;
  for (; n >= 128; p += 128, n -= 128) {
    x0 = _mm256_xor_si256(FCK_FOLD256(x0, k1024), FCK_LOAD(p));
    x1 = _mm256_xor_si256(FCK_FOLD256(x1, k1024), FCK_LOAD(p + 32));
    x2 = _mm256_xor_si256(FCK_FOLD256(x2, k1024), FCK_LOAD(p + 64));
    x3 = _mm256_xor_si256(FCK_FOLD256(x3, k1024), FCK_LOAD(p + 96));
  }
  x1 = _mm256_xor_si256(FCK_FOLD256(x0, k256), x1);
  x2 = _mm256_xor_si256(FCK_FOLD256(x1, k256), x2);
  x3 = _mm256_xor_si256(FCK_FOLD256(x2, k256), x3);
  for (; n >= 32; p += 32, n -= 32) x3 = _mm256_xor_si256(FCK_FOLD256(x3, k256), FCK_LOAD(p));
  const __m128i lo = _mm256_castsi256_si128(x3);
  __m128i x = _mm_xor_si128(FCK_FOLD128(lo), _mm256_extracti128_si256(x3, 1));
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(FCK_FOLD128(x), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#undef FCK_LOAD
#undef FCK_FOLD256
#undef FCK_FOLD128
  unsigned char rest[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(rest), x);
  const uint32_t c = crc32_base(0xFFFFFFFFu, rest, 16);  // zero start (zlib's inversion undone)
  return n ? crc32_base(c, p, n) : c;
}

bool fold_avx2_fits() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("vpclmulqdq")) return false;
#ifdef FASTCKPT_HAVE_ISAL
  // ISA-L's own 512-bit kernel is the faster one where AVX-512 is there.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return false;
#endif
  return true;
}

const bool kFoldAvx2 = fold_avx2_fits();
constexpr uint64_t kFoldMin = 256;  // below: the build's CRC-32 (set-up costs more than it saves)

// A copy with non-temporal (streaming) stores: the destination's lines are
// written without being read first (no read-for-ownership) and without
// evicting the caller's working set from the cache. A snapshot's arena is
// read next by the disk, not by this CPU. 1.5 GiB into warm memory here:
// 9.1-10.4 GB/s against memcpy's 6.8-7.2 in 256 KiB steps (glibc streams
// only copies larger than most of the last-level cache). The caller issues
// the store fence (stream_fence) before another thread may read the bytes.
__attribute__((target("avx2"))) void copy_stream_avx2(char* d, const char* s, uint64_t n) {
  const uint64_t head = std::min<uint64_t>((32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31, n);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  uint64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
}

bool stream_fits() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

const bool kStreamCopy = stream_fits();
constexpr uint64_t kStreamMin = 4096;  // below: memcpy
#endif

}  // namespace

void copy_streamed(char* d, const char* s, uint64_t n) {
#ifdef FASTCKPT_CRC_FOLD_AVX2
  if (kStreamCopy && n >= kStreamMin) return copy_stream_avx2(d, s, n);
#endif
  std::memcpy(d, s, n);
}

// Makes this thread's streamed stores visible in order before what it does next.
void stream_fence() {
#ifdef FASTCKPT_CRC_FOLD_AVX2
  if (kStreamCopy) _mm_sfence();
#endif
}

uint32_t crc32(uint32_t crc, const void* data, uint64_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
#ifdef FASTCKPT_CRC_FOLD_AVX2
  if (kFoldAvx2 && n >= kFoldMin) return crc32_fold_avx2(crc, p, n);
#endif
  return crc32_base(crc, p, n);
}

const char* crc32_kernel() {
#ifdef FASTCKPT_CRC_FOLD_AVX2
  if (kFoldAvx2) return "vpclmulqdq-avx2";
#endif
  return crc32_impl();
}

uint32_t crc32_with_build_impl(uint32_t crc, const void* data, uint64_t n) {
  return crc32_base(crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  static_assert(sizeof(z_off_t) >= sizeof(int64_t), "zlib's z_off_t must hold any file length");
  return static_cast<uint32_t>(::crc32_combine(crc1, crc2, static_cast<z_off_t>(len2)));
}

unsigned copy_crc32_many(char* const* dst, const char* const* src, const uint64_t* len, size_t n, uint32_t* crc,
                         unsigned threads) {
  constexpr uint64_t kPiece = 4u << 20;  // what one thread takes at a time
  constexpr uint64_t kStep = 256u << 10;  // copied, then folded while in the cache
  struct Piece {
    size_t range;
    uint64_t off, len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    crc[i] = 0;
    total += len[i];
    for (uint64_t off = 0; off < len[i]; off += kPiece)
      pieces.push_back(Piece{i, off, len[i] - off < kPiece ? len[i] - off : kPiece, 0});
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();) {
      Piece& p = pieces[k];
      char* d = dst[p.range] + p.off;
      const char* s = src[p.range] + p.off;
      uint32_t c = 0;
      for (uint64_t done = 0; done < p.len; done += kStep) {
        const uint64_t m = p.len - done < kStep ? p.len - done : kStep;
        copy_streamed(d + done, s + done, m);
        c = crc32(c, s + done, m);  // the source: in the cache since the copy read it (streamed stores leave
                                    // the destination out of it)
      }
      p.crc = c;
    }
    stream_fence();
  };
  std::vector<std::thread> helpers;
  const size_t want = threads > 1 ? threads - 1 : 0;
  for (size_t t = 0; t < want && t + 1 < pieces.size() && (t + 1) * kPiece < total; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads: the ones there are (and the caller) do it all
    }
  }
  work();
  for (std::thread& h : helpers) h.join();
  for (const Piece& p : pieces) crc[p.range] = p.off == 0 ? p.crc : crc32_combine(crc[p.range], p.crc, p.len);
  return static_cast<unsigned>(helpers.size());
}

const char* crc32_impl() {
#ifdef FASTCKPT_HAVE_ISAL
  return "isa-l";
#else
  return "zlib";
#endif
}

}  // namespace fastckpt
