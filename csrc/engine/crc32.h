// Zip CRC-32 (zlib's polynomial): ISA-L's crc32_gzip_refl where the build has
// it (FASTCKPT_HAVE_ISAL), else zlib's crc32_z; both give the same values.
#pragma once

#include <cstdint>

namespace fastckpt {

// The CRC-32 of n bytes, continuing from `crc` (zlib's convention:
// crc32(crc32(0, a), b) is the CRC of a followed by b).
uint32_t crc32(uint32_t crc, const void* data, uint64_t n);
// The CRC-32 of a followed by b, from crc1 = crc32(0, a), crc2 = crc32(0, b)
// and len2 = the length of b (zlib's crc32_combine).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
// The implementation crc32() uses in this build: "isa-l" or "zlib".
const char* crc32_impl();

}  // namespace fastckpt
