// Zip CRC-32 (zlib's polynomial): ISA-L's crc32_gzip_refl where the build has
// it (FASTCKPT_HAVE_ISAL), else zlib's crc32_z; both give the same values. On
// x86-64 CPUs with VPCLMULQDQ and AVX2 (and no AVX-512 for ISA-L's kernel),
// inputs of 256 bytes and more take the engine's own 256-bit folding.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastckpt {

// The CRC-32 of n bytes, continuing from `crc` (zlib's convention:
// crc32(crc32(0, a), b) is the CRC of a followed by b).
uint32_t crc32(uint32_t crc, const void* data, uint64_t n);
// The CRC-32 of a followed by b, from crc1 = crc32(0, a), crc2 = crc32(0, b)
// and len2 = the length of b (zlib's crc32_combine).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
// Copies n bytes from src to dst (not overlapping) as copy_crc32_many does:
// streamed where the CPU has AVX2, else memcpy. The calling thread must call
// stream_fence() before the destination is handed to the kernel or to another
// thread (a staging buffer submitted for a write).
void copy_streamed(char* dst, const char* src, uint64_t n);
void stream_fence();

// Copies n ranges (len[i] bytes from src[i] to dst[i], which must not overlap)
// and sets crc[i] to the CRC-32 of each, in one pass over the bytes: each
// 256 KiB step is folded into its CRC right after its copy, from the source's
// lines the copy just brought into the cache. Where the CPU has AVX2 the copy
// streams (non-temporal stores: the destination, which the disk reads next,
// neither read for ownership nor kept in the cache), each thread fencing its
// stores before it ends.
// Work is split into pieces of up to 4 MiB taken in turn by up to `threads`
// threads (the caller's and threads - 1 more; 0 counts as 1), a helper for
// each started 4 MiB beyond the first 4 MiB (starting a thread costs what
// copying some 100 KiB does: up to 4 MiB the caller copies alone; 1.2 ms of
// a 400 KiB state's first async_save went to a helper); the pieces' CRCs are
// joined with crc32_combine. Returns the helper threads it started.
unsigned copy_crc32_many(char* const* dst, const char* const* src, const uint64_t* len, size_t n, uint32_t* crc,
                         unsigned threads);
// The implementation this build links for crc32(): "isa-l" or "zlib".
const char* crc32_impl();
// What crc32() runs on this CPU for inputs of 256 bytes and more: "vpclmulqdq-avx2" (the
// engine's own folding, where the CPU has VPCLMULQDQ and AVX2 but ISA-L has no faster kernel
// for it), else crc32_impl().
const char* crc32_kernel();
// crc32() through the build's implementation only (the tests compare the two).
uint32_t crc32_with_build_impl(uint32_t crc, const void* data, uint64_t n);

}  // namespace fastckpt
