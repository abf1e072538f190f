#include "crc32.h"

#include <zlib.h>
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

const char* crc32_impl() {
#ifdef FASTCKPT_HAVE_ISAL
  return "isa-l";
#else
  return "zlib";
#endif
}

}  // namespace fastckpt
