// The engine's CRC-32 (fastckpt::crc32: ISA-L's crc32_gzip_refl where the
// build has it, else zlib's crc32_z; its own 256-bit folding on CPUs with
// VPCLMULQDQ and AVX2) against zlib's crc32_z, the reference:
// random sizes from 0 to past 1 MiB at random misalignments, continued across
// random splits, and crc32_combine of pieces. Run in both builds
// (-DFASTCKPT_NO_ISAL=ON gives the zlib one).
#include <zlib.h>

#include <random>

#include "util.h"

using namespace fct;

namespace {

uint32_t ref(uint32_t crc, const char* p, size_t n) {
  return static_cast<uint32_t>(::crc32_z(crc, reinterpret_cast<const Bytef*>(p), static_cast<z_size_t>(n)));
}

std::string hex(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

}  // namespace

TEST(crc32_is_the_implementation_this_build_chose, ONCE) {
  CHECK_EQ(std::string(fastckpt::crc32_impl()), std::string(FASTCKPT_EXPECT_CRC_IMPL));
  CHECK_EQ(fastckpt::crc32(0, "123456789", 9), 0xCBF43926u);  // the CRC-32 check value
  CHECK_EQ(fastckpt::crc32(0, "", 0), 0u);
  CHECK_EQ(fastckpt::crc32(0x12345678u, "", 0), 0x12345678u);  // no bytes: the running value unchanged
  CHECK_EQ(fastckpt::crc32(0, nullptr, 0), 0u);
}

TEST(crc32_matches_zlib_on_random_sizes_offsets_and_splits, ONCE) {
  const size_t max = (1u << 20) + 4099;
  const std::string data = random_bytes(max + 64, 77);
  std::mt19937_64 rng(5);
  std::vector<size_t> sizes = {0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 65, 127, 128, 255, 256, 257, 511, 512,
                               1023, 1024, 4095, 4096, 4097, 65535, 65536, 65537, 262144, 1u << 20, max};
  for (int i = 0; i < 300; ++i) {
    switch (rng() % 3) {
      case 0: sizes.push_back(rng() % 300); break;           // tails and small records
      case 1: sizes.push_back(rng() % (64u << 10)); break;
      default: sizes.push_back(rng() % (max + 1)); break;
    }
  }
  for (size_t n : sizes) {
    const size_t at = rng() % 64;  // every misalignment of the start
    const char* p = data.data() + at;
    const uint32_t want = ref(0, p, n);
    const std::string what = std::to_string(n) + " bytes at +" + std::to_string(at);
    CHECK_MSG(fastckpt::crc32(0, p, n) == want, what + ": " + hex(fastckpt::crc32(0, p, n)) + " != " + hex(want));
    // continued across a random split, from a random running value too
    const size_t k = n ? rng() % (n + 1) : 0;
    CHECK_MSG(fastckpt::crc32(fastckpt::crc32(0, p, k), p + k, n - k) == want, what + " split at " + std::to_string(k));
    const uint32_t seed = static_cast<uint32_t>(rng());
    CHECK_MSG(fastckpt::crc32(seed, p, n) == ref(seed, p, n), what + " from " + hex(seed));
    // pieces computed apart and combined, as read_ranges does
    CHECK_MSG(fastckpt::crc32_combine(fastckpt::crc32(0, p, k), fastckpt::crc32(0, p + k, n - k), n - k) == want,
              what + " combined at " + std::to_string(k));
  }
}

TEST(the_wide_kernel_matches_the_build_impl_at_every_length_around_its_steps, ONCE) {
  // crc32() on this CPU (crc32_kernel(): the engine's 256-bit folding where the CPU has
  // VPCLMULQDQ and AVX2, else the build's implementation) against the build's implementation
  // and zlib's: every length from 0 to 1300 bytes (the 128-, 32- and 16-byte steps and the tail
  // of the folding, and the 256-byte threshold), each at a random misalignment, from 0 and from
  // a random running value, then long inputs.
  const std::string kernel = fastckpt::crc32_kernel();
  CHECK_MSG(kernel == fastckpt::crc32_impl() || kernel == "vpclmulqdq-avx2", kernel);
#if defined(__x86_64__)
  if (kernel == "vpclmulqdq-avx2") CHECK(__builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx2"));
#endif
  std::printf("crc32 kernel on this CPU: %s (build: %s)\n", kernel.c_str(), fastckpt::crc32_impl());
  const std::string data = random_bytes((4u << 20) + 128, 79);
  std::mt19937_64 rng(7);
  auto check = [&](size_t n) {
    const char* p = data.data() + rng() % 64;
    const uint32_t seed = rng() % 2 ? static_cast<uint32_t>(rng()) : 0;
    const uint32_t want = ref(seed, p, n);
    CHECK_MSG(fastckpt::crc32(seed, p, n) == want, std::to_string(n) + " bytes from " + hex(seed));
    CHECK_MSG(fastckpt::crc32_with_build_impl(seed, p, n) == want, std::to_string(n) + " bytes (build impl)");
  };
  for (size_t n = 0; n <= 1300; ++n) check(n);
  for (size_t n : {4096u, 65536u + 17u, 1u << 20, (4u << 20) + 1u}) check(n);
}

TEST(crc32_combine_of_many_pieces_in_order, ONCE) {
  const std::string data = random_bytes(3u << 20, 78);
  std::mt19937_64 rng(6);
  uint32_t acc = 0;
  size_t off = 0, pieces = 0;
  while (off < data.size()) {
    size_t k = std::min<size_t>(data.size() - off, rng() % 4 == 0 ? rng() % 16 : rng() % (300u << 10));
    acc = pieces == 0 ? fastckpt::crc32(0, data.data(), k)
                      : fastckpt::crc32_combine(acc, fastckpt::crc32(0, data.data() + off, k), k);
    off += k;
    ++pieces;
  }
  CHECK(pieces > 10);
  CHECK_EQ(acc, ref(0, data.data(), data.size()));
  CHECK_EQ(fastckpt::crc32_combine(0, 0, 0), 0u);
  CHECK_EQ(fastckpt::crc32_combine(0xCBF43926u, 0, 0), 0xCBF43926u);
}

FCT_MAIN()

TEST(copy_crc32_many_copies_every_range_and_gives_each_ones_crc, ONCE) {
  // Ranges from empty to several pieces of 4 MiB (split across threads and
  // joined with crc32_combine), at odd addresses, on 1 to 5 threads (more
  // than pieces too): every destination byte is its source's, nothing
  // around a destination is written, and each CRC is zlib's.
  std::mt19937_64 rng(71);
  const std::vector<size_t> sizes = {0, 1, 4095, 262145, (4u << 20), (4u << 20) + 1, (9u << 20) + 333, 12345678};
  std::vector<std::string> src;
  for (size_t i = 0; i < sizes.size(); ++i) src.push_back(random_bytes(sizes[i], 80 + int(i)));
  for (unsigned threads : {0u, 1u, 2u, 5u}) {
    std::vector<std::string> dst_mem;
    std::vector<char*> dst;
    std::vector<const char*> sp;
    std::vector<uint64_t> len;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t shift = rng() % 64;
      dst_mem.emplace_back(sizes[i] + 128, '\x55');
      dst.push_back(&dst_mem.back()[0] + 64 + (shift % 7));
      sp.push_back(src[i].data());
      len.push_back(sizes[i]);
    }
    std::vector<uint32_t> crc(sizes.size(), 0xdeadbeef);
    const unsigned helpers =
        fastckpt::copy_crc32_many(dst.data(), sp.data(), len.data(), sizes.size(), crc.data(), threads);
    CHECK_EQ(helpers, threads > 1 ? threads - 1 : 0u);  // 29 MiB: work for every thread asked for
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t at = static_cast<size_t>(dst[i] - dst_mem[i].data());
      CHECK_BYTES(dst_mem[i].substr(at, sizes[i]), src[i]);
      CHECK_BYTES(dst_mem[i].substr(0, at), std::string(at, '\x55'));
      CHECK_BYTES(dst_mem[i].substr(at + sizes[i]), std::string(dst_mem[i].size() - at - sizes[i], '\x55'));
      CHECK_MSG(crc[i] == ref(0, src[i].data(), sizes[i]),
                "range " + std::to_string(i) + " on " + std::to_string(threads) + " threads: " + hex(crc[i]));
    }
  }
}

TEST(copy_crc32_many_starts_no_thread_for_a_small_state, ONCE) {
  // Up to 4 MiB in all the caller copies alone, however many ranges and
  // threads; past that, a helper for each started 4 MiB beyond the first.
  const std::vector<size_t> sizes = {200000, 100000, 50000, 25000, (3u << 20), 7};
  std::vector<std::string> src, dst_mem;
  std::vector<char*> dst;
  std::vector<const char*> sp;
  std::vector<uint64_t> len;
  for (size_t i = 0; i < sizes.size(); ++i) src.push_back(random_bytes(sizes[i], 120 + int(i)));
  for (size_t i = 0; i < sizes.size(); ++i) {
    dst_mem.emplace_back(sizes[i], '\0');
    dst.push_back(&dst_mem[i][0]);
    sp.push_back(src[i].data());
    len.push_back(sizes[i]);
  }
  std::vector<uint32_t> crc(sizes.size());
  CHECK_EQ(fastckpt::copy_crc32_many(dst.data(), sp.data(), len.data(), sizes.size(), crc.data(), 8), 0u);
  for (size_t i = 0; i < sizes.size(); ++i) {
    CHECK_BYTES(dst_mem[i], src[i]);
    CHECK_EQ(crc[i], ref(0, src[i].data(), sizes[i]));
  }
  // 4 MiB + 1 in two ranges: one helper, though three were allowed
  const std::vector<uint64_t> big = {(2u << 20), (2u << 20) + 1};
  std::vector<std::string> bs = {random_bytes(big[0], 130), random_bytes(big[1], 131)};
  std::vector<std::string> bd = {std::string(big[0], '\0'), std::string(big[1], '\0')};
  std::vector<char*> bdp = {&bd[0][0], &bd[1][0]};
  std::vector<const char*> bsp = {bs[0].data(), bs[1].data()};
  std::vector<uint32_t> bc(2);
  CHECK_EQ(fastckpt::copy_crc32_many(bdp.data(), bsp.data(), big.data(), 2, bc.data(), 4), 1u);
  CHECK_BYTES(bd[0], bs[0]);
  CHECK_BYTES(bd[1], bs[1]);
  CHECK_EQ(bc[1], ref(0, bs[1].data(), big[1]));
}

TEST(copy_crc32_many_is_exact_at_every_destination_phase_and_length_around_its_steps, ONCE) {
  // The streamed copy aligns its destination to 32 bytes, moves 128 at a
  // time and finishes with memcpy: every phase of the destination within 64
  // bytes and lengths around those steps (from the smallest streamed one)
  // copy every byte, touch nothing around the range, and give zlib's CRC.
  const std::string src = random_bytes((256u << 10) + 4096, 140);
  for (uint64_t len : {uint64_t(4095), uint64_t(4096), uint64_t(4097), uint64_t(4096 + 31), uint64_t(4096 + 127),
                       uint64_t(4096 + 128), uint64_t(8191), uint64_t(256u << 10), uint64_t((256u << 10) + 65)}) {
    for (size_t phase = 0; phase < 64; phase += 7) {
      std::string mem(len + 256, '\x33');
      char* d = &mem[0] + 64 + phase;
      const char* s = src.data() + (phase * 3) % 64;
      uint32_t crc = 0;
      CHECK_EQ(fastckpt::copy_crc32_many(&d, &s, &len, 1, &crc, 1), 0u);
      CHECK_BYTES(mem.substr(64 + phase, len), std::string(s, len));
      CHECK_BYTES(mem.substr(0, 64 + phase), std::string(64 + phase, '\x33'));
      CHECK_BYTES(mem.substr(64 + phase + len), std::string(mem.size() - 64 - phase - len, '\x33'));
      CHECK_MSG(crc == ref(0, s, len), "length " + std::to_string(len) + " at phase " + std::to_string(phase));
    }
  }
}
