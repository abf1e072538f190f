#include "crc32.h"

#include <zlib.h>

#include <atomic>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>
#ifdef FASTCKPT_HAVE_ISAL
#include <isa-l/crc.h>
#endif

namespace fastckpt {

uint32_t crc32(uint32_t crc, const void* data, uint64_t n) {
#ifdef FASTCKPT_HAVE_ISAL
  // Same running value as zlib's crc32 (inversions inside), 64-bit length.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
#else
  return static_cast<uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n)));
#endif
}

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  static_assert(sizeof(z_off_t) >= sizeof(int64_t), "zlib's z_off_t must hold any file length");
  return static_cast<uint32_t>(::crc32_combine(crc1, crc2, static_cast<z_off_t>(len2)));
}

void copy_crc32_many(char* const* dst, const char* const* src, const uint64_t* len, size_t n, uint32_t* crc,
                     unsigned threads) {
  constexpr uint64_t kPiece = 4u << 20;  // what one thread takes at a time
  constexpr uint64_t kStep = 256u << 10;  // copied, then folded while in the cache
  struct Piece {
    size_t range;
    uint64_t off, len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < n; ++i) {
    crc[i] = 0;
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
        std::memcpy(d + done, s + done, m);
        c = crc32(c, d + done, m);
      }
      p.crc = c;
    }
  };
  std::vector<std::thread> helpers;
  const size_t want = threads > 1 ? threads - 1 : 0;
  for (size_t t = 0; t < want && t + 1 < pieces.size(); ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads: the ones there are (and the caller) do it all
    }
  }
  work();
  for (std::thread& h : helpers) h.join();
  for (const Piece& p : pieces) crc[p.range] = p.off == 0 ? p.crc : crc32_combine(crc[p.range], p.crc, p.len);
}

const char* crc32_impl() {
#ifdef FASTCKPT_HAVE_ISAL
  return "isa-l";
#else
  return "zlib";
#endif
}

}  // namespace fastckpt
