// Round trips through Writer and read_ranges: sizes around block and buffer
// boundaries, chunked appends, write_at gaps, coalesced, random-order and
// direct (aligned) range reads, and several writers sharing one Engine.
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

#include "temp_file.h"
#include "util.h"

using namespace fct;

namespace {

void check_write_stats(const WriteStats& st, uint64_t size, const EngineConfig& cfg) {
  CHECK_EQ(st.bytes, size);
  CHECK_EQ(st.backend, std::string(expected_backend_name()));
  CHECK_EQ(st.direct, cfg.direct);
  if (st.direct) {
    CHECK(st.fallback.empty());
    CHECK(st.alignment > 0);
    CHECK_EQ(st.alignment & (st.alignment - 1), 0u);
    CHECK_EQ(cfg.buffer_size % st.alignment, 0u);
  } else {
    CHECK_EQ(st.alignment, 0u);
    CHECK_CONTAINS(st.fallback, "disabled by configuration");
  }
  CHECK(st.seconds >= st.flush_seconds);
  CHECK(st.flush_seconds >= 0);
}

void roundtrip_sizes(const EngineConfig& cfg, const std::vector<size_t>& sizes) {
  TempDir dir;
  Engine eng(cfg);
  int i = 0;
  for (size_t n : sizes) {
    std::string path = dir.file("rt" + std::to_string(i++) + ".bin");
    std::string data = random_bytes(n, n + 17);
    WriteStats st = save(eng, path, data);
    check_write_stats(st, n, cfg);
    CHECK_EQ(st.requests, (n + cfg.buffer_size - 1) / cfg.buffer_size);
    CHECK_EQ(file_size(path), static_cast<int64_t>(n));
    CHECK_BYTES(read_file(path), data);
    evict(path);  // the disk path: read_ranges copies cached bytes from the page cache
    ReadStats rs;
    CHECK_BYTES(load(eng, path, n, &rs), data);
    CHECK_EQ(rs.bytes, n);
    CHECK(rs.bytes_read >= n);
    if (n) {
      CHECK_EQ(rs.backend, std::string(expected_backend_name()));
      CHECK_EQ(rs.direct, cfg.direct);
    } else {  // nothing to read: no backend needed
      CHECK_EQ(rs.requests, 0u);
      CHECK_EQ(rs.backend, std::string("page cache"));
    }
    CHECK_POOL_FULL(eng);
    CHECK_NO_TEMP_FILES(dir.path());
  }
  // Only the final files remain.
  CHECK_EQ(list_dir(dir.path()).size(), sizes.size());
}

}  // namespace

TEST(sizes_around_block_and_buffer_boundaries, ALL) {
  EngineConfig cfg = config();
  const size_t bs = cfg.buffer_size;
  roundtrip_sizes(cfg, {0, 1, 511, 512, 513, 4095, 4096, 4097, bs - 1, bs, bs + 1, 4 * bs, 4 * bs + 4097,
                        (20u << 20) + 123});
}

TEST(sizes_spanning_default_8mib_buffers, ALL) {
  // The default 8 MiB staging buffers (three of them): 20 MiB + 123 bytes
  // spans three buffers, the last one partly filled.
  EngineConfig cfg = config(8u << 20, 3, 3);
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (20u << 20) + 123;
  std::string data = random_bytes(n, 99);
  std::string path = dir.file("big.bin");
  WriteStats st = save(eng, path, data, (1u << 20) + 7);
  check_write_stats(st, n, cfg);
  CHECK_EQ(st.requests, 3u);
  CHECK_BYTES(read_file(path), data);
  // Ranges straddling the buffer boundaries, read back in one call.
  std::vector<std::pair<size_t, size_t>> spans = {
      {(8u << 20) - 100, 200}, {(16u << 20) - 1, 2}, {n - 5, 5}, {0, 3}, {(8u << 20) - 4096, 8192}};
  std::vector<std::string> got(spans.size());
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < spans.size(); ++i) {
    got[i].assign(spans[i].second, '\0');
    rs.push_back(ReadRange{&got[i][0], spans[i].second, spans[i].first});
  }
  fastckpt::read_ranges(eng, path, rs);
  for (size_t i = 0; i < spans.size(); ++i) CHECK_BYTES(got[i], data.substr(spans[i].first, spans[i].second));
  CHECK_BYTES(load(eng, path, n), data);
  CHECK_POOL_FULL(eng);
}

TEST(chunked_appends_of_random_sizes, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (3u << 20) + 4321;
  std::string data = random_bytes(n, 5);
  std::string path = dir.file("chunks.bin");
  {
    Writer w(eng, path, -1);
    std::mt19937 rng(7);
    size_t off = 0;
    while (off < n) {
      size_t k = std::min<size_t>(n - off, 1 + rng() % 100000);
      if (rng() % 8 == 0) k = std::min<size_t>(n - off, 1 + rng() % 7);
      w.append(data.data() + off, k);
      off += k;
      CHECK_EQ(w.position(), off);
    }
    w.append(nullptr, 0);  // an empty append is allowed
    WriteStats st = w.commit();
    check_write_stats(st, n, cfg);
  }
  CHECK_BYTES(read_file(path), data);
  CHECK_BYTES(load(eng, path, n), data);
}

TEST(append_computes_the_zip_crc32_of_the_data, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  CHECK_EQ(fastckpt::crc32(0, "123456789", 9), 0xCBF43926u);  // the CRC-32 check value
  CHECK_EQ(fastckpt::crc32(0, "", 0), 0u);
  const size_t n = (2u << 20) + 12345;  // several 256 KiB CRC pieces and staging buffers
  std::string data = random_bytes(n, 31);
  uint32_t whole = fastckpt::crc32(0, data.data(), n);
  uint32_t split = fastckpt::crc32(fastckpt::crc32(0, data.data(), 1000), data.data() + 1000, n - 1000);
  CHECK_EQ(split, whole);
  std::string path = dir.file("crc.bin");
  uint32_t crc = 0, crc_b = 0;
  {
    Writer w(eng, path, -1);
    std::mt19937 rng(9);
    size_t off = 0;
    while (off < n) {
      size_t k = std::min<size_t>(n - off, 1 + rng() % 700000);
      w.append(data.data() + off, k, &crc);
      off += k;
    }
    w.append_zeros(10);  // not part of the checksum
    w.append("xy", 2, &crc_b);
    w.commit();
  }
  CHECK_EQ(crc, whole);
  CHECK_EQ(crc_b, fastckpt::crc32(0, "xy", 2));
  CHECK_BYTES(read_file(path), data + std::string(10, '\0') + "xy");
}

TEST(write_at_gaps_are_zero_filled_and_append_zeros, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const uint64_t bs = cfg.buffer_size;
  std::string a = random_bytes(1000, 1), b = random_bytes(3 * bs + 5, 2), c = random_bytes(77, 3);
  std::string expect;
  std::string path = dir.file("gaps.bin");
  {
    Writer w(eng, path, -1);
    w.write_at(a.data(), a.size(), 10);  // gap before the first byte
    expect.append(10, '\0');
    expect += a;
    w.write_at(b.data(), b.size(), 2 * bs + 1);  // gap over whole buffers
    expect.append(2 * bs + 1 - expect.size(), '\0');
    expect += b;
    w.write_at(c.data(), c.size(), w.position());  // no gap
    expect += c;
    w.append_zeros(bs + 3);
    expect.append(bs + 3, '\0');
    w.write_at(nullptr, 0, w.position() + 4096);  // a trailing gap extends the file
    expect.append(4096, '\0');
    w.append(a.data(), 1);
    expect += a.substr(0, 1);
    CHECK_EQ(w.position(), expect.size());
    WriteStats st = w.commit();
    check_write_stats(st, expect.size(), cfg);
  }
  CHECK_BYTES(read_file(path), expect);
  CHECK_BYTES(load(eng, path, expect.size()), expect);

  // A file that is only zeros, ending in a gap.
  std::string zpath = dir.file("zeros.bin");
  {
    Writer w(eng, zpath, 12345);
    w.append_zeros(5 * bs + 1);
    w.write_at(nullptr, 0, 6 * bs + 9);
    w.commit();
  }
  CHECK_BYTES(read_file(zpath), std::string(6 * bs + 9, '\0'));
  CHECK_POOL_FULL(eng);
}

TEST(many_small_unaligned_ranges_are_coalesced, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (2u << 20) + 333;
  std::string data = random_bytes(n, 11);
  std::string path = dir.file("small.bin");
  save(eng, path, data);

  // 3000 ranges of 1..300 bytes, 1..700 bytes apart, requested in random order.
  std::mt19937_64 rng(3);
  std::vector<std::pair<size_t, size_t>> spans;
  size_t off = 1;
  while (spans.size() < 3000) {
    size_t len = 1 + rng() % 300;
    if (off + len > n) break;
    spans.push_back({off, len});
    off += len + 1 + rng() % 700;
  }
  std::shuffle(spans.begin(), spans.end(), rng);
  std::string out(n, '\0');
  std::vector<ReadRange> rs;
  uint64_t want = 0;
  for (auto& s : spans) {
    rs.push_back(ReadRange{&out[s.first], s.second, s.first});
    want += s.second;
  }
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  CHECK_EQ(st.bytes, want);
  for (auto& s : spans)
    if (std::memcmp(&out[s.first], &data[s.first], s.second) != 0)
      fail(__FILE__, __LINE__, "range at " + std::to_string(s.first) + " differs");
  // Coalescing: a few staging-buffer reads, not one per range.
  CHECK_MSG(st.requests * 20 < spans.size(),
            std::to_string(st.requests) + " requests for " + std::to_string(spans.size()) + " ranges");
  CHECK_EQ(st.direct_requests, 0u);
  CHECK_POOL_FULL(eng);
}

TEST(large_ranges_in_random_order_overlapping_and_empty, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (5u << 20) + 17;
  std::string data = random_bytes(n, 12);
  std::string path = dir.file("large.bin");
  save(eng, path, data, 65537);

  std::mt19937_64 rng(4);
  std::vector<std::pair<size_t, size_t>> spans;
  for (int i = 0; i < 200; ++i) {
    size_t len = rng() % 4 == 0 ? 0 : 1 + rng() % (300u << 10);
    size_t off = rng() % (n - len + 1);
    spans.push_back({off, len});
  }
  spans.push_back({0, n});      // the whole file, overlapping everything
  spans.push_back({n - 1, 1});  // the last byte
  spans.push_back({n, 0});      // empty at end of file
  std::vector<std::string> got(spans.size());
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < spans.size(); ++i) {
    got[i].assign(spans[i].second, '\x77');
    rs.push_back(ReadRange{got[i].empty() ? nullptr : &got[i][0], spans[i].second, spans[i].first});
  }
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  uint64_t want = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    CHECK_BYTES(got[i], data.substr(spans[i].first, spans[i].second));
    want += spans[i].second;
  }
  CHECK_EQ(st.bytes, want);
  CHECK_POOL_FULL(eng);
}

TEST(aligned_ranges_are_read_directly_into_caller_memory, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (1u << 20) + 100;
  std::string data = random_bytes(n, 21);
  std::string path = dir.file("aligned.bin");
  save(eng, path, data);
  evict(path);  // the disk path: read_ranges copies cached bytes from the page cache

  // Aligned destination, offset and length: eligible for the direct path,
  // including a range larger than a staging buffer.
  AlignedBuf a(cfg.buffer_size * 3 + 8192), b(4096 * 5);
  std::string c(1000, '\0');
  std::vector<ReadRange> rs = {
      {a.p, cfg.buffer_size * 3 + 8192, 4096},   // direct, split into buffer-sized requests
      {b.p, 4096 * 5, 8192 * 3},                 // direct
      {&c[0], 1000, 4096 * 200 + 3},             // unaligned: through a staging buffer
  };
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  CHECK_BYTES(a.str(0, a.size), data.substr(4096, a.size));
  CHECK_BYTES(b.str(0, b.size), data.substr(8192 * 3, b.size));
  CHECK_BYTES(c, data.substr(4096 * 200 + 3, 1000));
  if (cfg.direct) {
    CHECK(st.direct);
    CHECK_EQ(st.direct_requests, 4u + 1u);  // a: 3 full buffers + 8 KiB; b: one
  } else {
    CHECK(!st.direct);
    CHECK_EQ(st.direct_requests, 0u);
  }

  // An aligned range whose destination is not aligned goes through staging.
  AlignedBuf d(4096 * 2 + 1);
  evict(path);  // a cache miss starts the kernel's readahead
  ReadStats st2 = fastckpt::read_ranges(eng, path, {{d.p + 1, 4096 * 2, 4096}});
  CHECK_EQ(st2.direct_requests, 0u);
  CHECK_BYTES(d.str(1, 4096 * 2), data.substr(4096, 4096 * 2));

  // The whole file (unaligned length) into an aligned buffer: the aligned
  // body directly, the tail through staging.
  AlignedBuf e(n);
  evict(path);
  ReadStats st3 = fastckpt::read_ranges(eng, path, {{e.p, n, 0}});
  CHECK_BYTES(e.str(0, n), data);
  if (cfg.direct) CHECK(st3.direct_requests > 0);
  CHECK(st3.requests > st3.direct_requests);
  CHECK_POOL_FULL(eng);
}

TEST(unaligned_ranges_into_memory_at_their_phase_read_their_bodies_directly, ALL) {
  // A file whose tensors are packed at unaligned offsets (safetensors' own,
  // torch.save's 64-byte records), each read into memory that starts at its
  // offset's phase within a page (fastckpt's host_storage): the aligned body
  // of each range goes straight into it, the head and tail (less than a
  // block, shared with the neighbours' in one window) through staging. Every
  // byte and CRC as asked, nothing written outside a range's own memory
  // (guard bytes around each), and a range too short for a body, or at
  // another phase, staged whole.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (3u << 20) + 777;
  const std::string data = random_bytes(n, 53);
  const std::string path = dir.file("packed.bin");
  save(eng, path, data);
  evict(path);
  // (offset, length): back to back from an 8-byte header-like start; one
  // longer than three staging buffers; a short one; one off its phase (shift).
  struct Span { size_t off, len, shift; };
  std::vector<Span> spans;
  size_t off = 8 + 1000;
  for (size_t len : {size_t(300000), size_t(cfg.buffer_size) * 3 + 12344, size_t(2000), size_t(70000),
                     size_t(500000)}) {
    spans.push_back({off, len, 0});
    off += len;
  }
  spans.push_back({off, 200000, 8});  // dst - off not a multiple of the block: no direct body
  off += 200000;
  CHECK(off < n);
  const size_t guard = 64;
  std::vector<std::unique_ptr<AlignedBuf>> bufs;
  std::vector<uint32_t> crcs(spans.size(), 0);
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    const size_t phase = (s.off + s.shift) % 4096;
    bufs.emplace_back(new AlignedBuf(phase + s.len + guard + 4096));  // filled with 0x55
    rs.push_back(ReadRange{bufs.back()->p + phase, s.len, s.off, &crcs[i]});
  }
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  uint64_t want = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    const size_t phase = (s.off + s.shift) % 4096;
    CHECK_BYTES(bufs[i]->str(phase, s.len), data.substr(s.off, s.len));
    CHECK_MSG(crcs[i] == fastckpt::crc32(0, data.data() + s.off, s.len), "CRC of range " + std::to_string(i));
    CHECK_BYTES(bufs[i]->str(0, phase), std::string(phase, '\x55'));
    CHECK_BYTES(bufs[i]->str(phase + s.len, guard), std::string(guard, '\x55'));
    want += s.len;
  }
  CHECK_EQ(st.bytes, want);
  if (cfg.direct) {
    // Four ranges have a body (of one or more buffer-sized jobs each); the
    // 2000-byte range and the one off its phase have none.
    CHECK_MSG(st.direct_requests >= 4u, std::to_string(st.direct_requests));
    CHECK(st.requests > st.direct_requests);
    // Each block is read once: the heads and tails share their windows.
    CHECK_MSG(st.bytes_read <= want + 2 * 4096 * spans.size(), std::to_string(st.bytes_read));
  } else {
    CHECK_EQ(st.direct_requests, 0u);
  }
  CHECK_POOL_FULL(eng);

  // Faults on the same reads: every read cut short (requeued for the rest,
  // which must stay aligned for the direct bodies) gives the same bytes and
  // CRCs; an EIO part way is an IoError, with nothing written outside any
  // range's memory and every staging buffer back.
  auto reset = [&] {
    for (size_t i = 0; i < spans.size(); ++i) {
      std::memset(bufs[i]->p, 0x55, bufs[i]->size);
      crcs[i] = 0;
    }
  };
  auto guards_intact = [&] {
    for (size_t i = 0; i < spans.size(); ++i) {
      const size_t phase = (spans[i].off + spans[i].shift) % 4096;
      CHECK_BYTES(bufs[i]->str(0, phase), std::string(phase, '\x55'));
      CHECK_BYTES(bufs[i]->str(phase + spans[i].len, guard), std::string(guard, '\x55'));
    }
  };
  reset();
  evict(path);
  fault::arm(short_rule(fault::Op::Read, 1, short_unit(), 0));
  fastckpt::read_ranges(eng, path, rs);
  CHECK(fault::fired() > 0);
  fault::clear();
  for (size_t i = 0; i < spans.size(); ++i) {
    const size_t phase = (spans[i].off + spans[i].shift) % 4096;
    CHECK_BYTES(bufs[i]->str(phase, spans[i].len), data.substr(spans[i].off, spans[i].len));
    CHECK_MSG(crcs[i] == fastckpt::crc32(0, data.data() + spans[i].off, spans[i].len),
              "CRC of range " + std::to_string(i) + " after short reads");
  }
  guards_intact();
  CHECK_POOL_FULL(eng);

  reset();
  evict(path);
  fault::arm(rule(fault::Op::Read, 3, EIO));
  bool threw = false;
  try {
    fastckpt::read_ranges(eng, path, rs);
  } catch (const IoError& e) {
    threw = true;
    CHECK_EQ(e.err(), EIO);
  }
  fault::clear();
  CHECK(threw);
  guards_intact();
  CHECK_POOL_FULL(eng);
}

TEST(packed_small_ranges_are_read_by_few_vectored_requests, ALL) {
  // A file of small tensors packed at unaligned offsets (a model's biases and
  // norms): each range's body and the blocks it shares with its neighbours
  // are read by one vectored request per run of up to a buffer's size, not
  // two requests per range. Every byte and CRC as asked, nothing written
  // around a range; the same under short reads (requeued for the rest of the
  // segments), an EIO there is a "preadv" IoError naming the file and an
  // offset, and the file ending mid-request a TruncatedError naming it, every
  // staging buffer back after each.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  std::vector<size_t> lens;
  for (size_t i = 0; i < 48; ++i) lens.push_back(std::vector<size_t>{9000, 13001, 5000, 20000, 2000, 30000}[i % 6]);
  PackedRanges packed(1008, lens);
  const std::string path = dir.file("packed_small.bin");
  const std::string data = saved_cold(eng, path, packed.end + 5000, 61);
  ReadStats st = fastckpt::read_ranges(eng, path, packed.ranges);
  CHECK_PACKED(packed, data);
  CHECK_EQ(st.bytes, packed.end - 1008);
  if (cfg.direct) {
    CHECK_MSG(st.vectored_requests > 0, std::to_string(st.vectored_requests));
    CHECK_MSG(st.direct_requests >= 40u, std::to_string(st.direct_requests));  // all but the 2000-byte ranges' bodies
    // (before: a request per body and per window between two ranges, 90 or more)
    CHECK_MSG(st.requests * 3 <= lens.size(), std::to_string(st.requests));
    CHECK_MSG(st.bytes_read <= packed.end - 1008 + 2 * 4096, std::to_string(st.bytes_read));  // each block once
  }
  CHECK_POOL_FULL(eng);

  PackedRanges again(1008, lens);
  evict(path);
  fault::arm(short_rule(fault::Op::Read, 1, short_unit(), 0));  // every read cut short
  st = fastckpt::read_ranges(eng, path, again.ranges);
  CHECK(fault::fired() > 0);
  fault::clear();
  CHECK_PACKED(again, data);
  CHECK_POOL_FULL(eng);

  PackedRanges failing(1008, lens);
  evict(path);
  fault::arm(rule(fault::Op::Read, 2, EIO));
  IoError e = CHECK_THROWS(IoError, fastckpt::read_ranges(eng, path, failing.ranges));
  fault::clear();
  CHECK_EQ(e.err(), EIO);
  CHECK_EQ(e.path(), path);
  if (cfg.direct) {
    CHECK_EQ(e.op(), std::string("preadv"));
    CHECK_CONTAINS(std::string(e.what()), "preadv " + path + " off=");
  }
  CHECK(e.offset() >= 0 && static_cast<uint64_t>(e.offset()) < packed.end);
  for (size_t i = 0; i < failing.ranges.size(); ++i) {
    const size_t phase = failing.offs[i] % 4096;
    CHECK_BYTES(failing.bufs[i]->str(0, phase), std::string(phase, '\x55'));
    CHECK_BYTES(failing.bufs[i]->str(phase + lens[i], PackedRanges::kGuard), std::string(PackedRanges::kGuard, '\x55'));
  }
  CHECK_POOL_FULL(eng);

  // The file ending in the middle of a vectored read (truncated after it was
  // opened: a zero-length read) is a TruncatedError naming it.
  PackedRanges shrunk(1008, lens);
  evict(path);
  fault::arm(rule(fault::Op::ReadCached, 1, EAGAIN, 0));  // whatever DONTNEED left cached: the disk path
  fault::arm(short_rule(fault::Op::Read, 2, 0, 1));
  TruncatedError t = CHECK_THROWS(TruncatedError, fastckpt::read_ranges(eng, path, shrunk.ranges));
  fault::clear();
  CHECK_EQ(t.path(), path);
  CHECK_CONTAINS(std::string(t.what()), "truncated");
  CHECK_POOL_FULL(eng);
}

TEST(records_between_small_gaps_are_read_through_them, ALL) {
  // fastckpt's own layout: each record at a block boundary after a block of
  // header and padding that no range asks for. Gaps up to 64 KiB are read
  // through into staging and dropped, so the records are read by a few
  // vectored requests; a gap beyond that starts a new request. Every byte
  // where it belongs, nothing around it, every staging buffer back.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("records.bin");
  const std::string data = saved_cold(eng, path, 2u << 20, 63);
  std::vector<size_t> at;
  for (size_t i = 0; i < 40; ++i) at.push_back(4096 + i * 16384);  // 12 KiB records every 16 KiB (4 KiB gaps)
  at.push_back(4096 + 40 * 16384 + (1u << 20));  // one more, 1 MiB further: beyond any gap read through
  PackedRanges records(at, std::vector<size_t>(41, 12288));
  ReadStats st = fastckpt::read_ranges(eng, path, records.ranges);
  CHECK_PACKED(records, data);
  CHECK_EQ(st.bytes, 41u * 12288);
  if (cfg.direct) {
    CHECK_EQ(st.direct_requests, 41u);
    // 40 x 16 KiB in 64 KiB requests: 10 or so, and the far record alone
    CHECK_MSG(st.requests <= 12u && st.vectored_requests >= 9u, std::to_string(st.requests));
    CHECK_MSG(st.staged_bytes <= 40u * 4096 && st.staged_bytes >= 30u * 4096, std::to_string(st.staged_bytes));
    CHECK_EQ(st.bytes_read, st.bytes + st.staged_bytes);
  }
  CHECK_POOL_FULL(eng);
}

TEST(records_ending_inside_a_block_still_join_one_request, ALL) {
  // torch's and fastckpt's records rarely end on a block: a record's last
  // bytes are a staging window rounded up to the block, whose bytes past the
  // record are the next header's. The next record's bytes must arrive and
  // lie past them, so the window is no request's end: 60 records of 100 to
  // 9 KiB, each at a block boundary, are read by a few vectored requests,
  // every byte where it belongs and nothing around it.
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("tails.bin");
  const std::string data = saved_cold(eng, path, 2u << 20, 71);
  std::vector<size_t> at, lens;
  for (size_t i = 0, off = 4096; i < 60; ++i) {
    lens.push_back(100 + i * 150);
    at.push_back(off);
    off += (lens.back() + 4095) / 4096 * 4096 + 4096;  // the next record after a block of header
  }
  PackedRanges records(at, lens);
  const std::vector<ReadRange>& rs = records.ranges;
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  CHECK_PACKED(records, data);
  size_t bytes = 0;
  for (size_t len : lens) bytes += len;
  CHECK_EQ(st.bytes, bytes);
  // about 700 KiB in 64 KiB requests: 11 (58 when each window ended its request)
  if (cfg.direct) CHECK_MSG(st.requests <= 14u, std::to_string(st.requests));
  CHECK_POOL_FULL(eng);

  // The file cut inside a record in the middle of a request: a TruncatedError naming it.
  CHECK(::truncate(path.c_str(), static_cast<off_t>(rs[30].off + 50)) == 0);
  evict(path);
  TruncatedError t = CHECK_THROWS(TruncatedError, fastckpt::read_ranges(eng, path, rs));
  CHECK_EQ(t.path(), path);
  CHECK_POOL_FULL(eng);
}

TEST(small_staged_windows_share_a_staging_buffer, ALL) {
  // Windows far apart (each its own request) take slices of one staging
  // buffer: with a single 64 KiB buffer in the pool, as many of them are in
  // flight at once as it has page-aligned slices (16; a reader keeps up to
  // read_requests(), 32 here), before: one, each holding the whole buffer;
  // every byte where it belongs.
  EngineConfig cfg = config(64u << 10, 1, 4);
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("far.bin");
  const std::string data = saved_cold(eng, path, 3u << 20, 62);
  std::string out(20 * 3001, '\0');
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < 20; ++i) rs.push_back(ReadRange{&out[i * 3001], 3001, i * 150000 + 17});
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  for (size_t i = 0; i < 20; ++i) CHECK_BYTES(out.substr(i * 3001, 3001), data.substr(i * 150000 + 17, 3001));
  CHECK_EQ(st.requests, 20u);
  CHECK_MSG(st.peak_requests == std::min<uint64_t>(cfg.read_requests(), cfg.buffer_size / 4096),
            std::to_string(st.peak_requests));
  CHECK_POOL_FULL(eng);
}

TEST(borrowed_ranges_at_the_file_phase_are_written_straight_from_memory, ALL) {
  // Writer::append_borrowed: a range whose memory sits at its file offset's
  // phase has its aligned body written O_DIRECT straight from that memory
  // (no copy), its head and tail through the staging buffers beside the
  // neighbours' bytes; a range at another phase, or too short, is copied.
  // The file holds every byte in order, each CRC is that of its bytes, the
  // memory is never written, and short writes are requeued. (Failed lent
  // writes: test_faults.cc, run_write_fault with `lent`.)
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  const std::string path = dir.file("borrowed.bin");
  const std::string old = random_bytes(5000, 60);
  save(eng, path, old);
  struct Part { size_t len; bool borrow; size_t shift; };
  // After a 1000-byte header: one longer than three staging buffers, a small
  // staged record, one just over a block past a page boundary, one too short
  // for a body, one off its phase (shift 8), a last one ending mid-block.
  const std::vector<Part> parts = {{1000, false, 0}, {size_t(cfg.buffer_size) * 3 + 12344, true, 0},
                                   {700, false, 0},   {70000, true, 0},
                                   {3000, true, 0},   {200000, true, 8},
                                   {300001, true, 0}};
  std::string want;
  std::vector<std::string> src;
  for (size_t i = 0; i < parts.size(); ++i) src.push_back(random_bytes(parts[i].len, 61 + int(i)));
  std::vector<std::unique_ptr<AlignedBuf>> mem(parts.size());
  std::vector<size_t> at(parts.size(), 0);  // each lent range's phase in its memory
  auto write_all = [&](std::vector<uint32_t>& crcs) {
    Writer w(eng, path, -1);
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      if (!p.borrow) {
        w.append(src[i].data(), p.len);
        continue;
      }
      const size_t phase = (w.position() + p.shift) % 4096;
      if (!mem[i]) {
        mem[i].reset(new AlignedBuf(phase + p.len + 4096));
        std::memcpy(mem[i]->p + phase, src[i].data(), p.len);
        at[i] = phase;
      }
      CHECK_EQ(at[i], phase);  // the same layout every time
      w.append_borrowed(mem[i]->p + phase, p.len, &crcs[i]);
    }
    return w.commit();
  };
  for (const std::string& s : src) want += s;
  std::vector<uint32_t> crcs(parts.size(), 0);
  WriteStats st = write_all(crcs);
  CHECK_BYTES(read_file(path), want);
  uint64_t matched = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].borrow) continue;
    CHECK_MSG(crcs[i] == fastckpt::crc32(0, src[i].data(), parts[i].len), "CRC of part " + std::to_string(i));
    if (parts[i].shift == 0 && parts[i].len > 8 * 4096) matched += parts[i].len;
  }
  if (cfg.direct) {
    // The bodies of the three long ranges at their phase: all but a head and
    // a tail under a block each; nothing of the others.
    CHECK_MSG(st.borrowed_bytes > 0 && st.borrowed_bytes <= matched, std::to_string(st.borrowed_bytes));
    CHECK_MSG(st.borrowed_bytes + 3 * 2 * 4096 >= matched, std::to_string(st.borrowed_bytes) + " of " +
                                                               std::to_string(matched));
  } else {
    CHECK_EQ(st.borrowed_bytes, 0u);
  }
  for (size_t i = 0; i < parts.size(); ++i) {  // the lent memory is only read
    if (!mem[i]) continue;
    CHECK_BYTES(mem[i]->str(at[i], parts[i].len), src[i]);
    CHECK_BYTES(mem[i]->str(0, at[i]), std::string(at[i], '\x55'));
  }
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);

  // Every write cut short: requeued (the rest of a direct body still whole
  // blocks), the same file.
  fault::arm(short_rule(fault::Op::Write, 1, short_unit(), 0));
  std::fill(crcs.begin(), crcs.end(), 0);
  WriteStats st2 = write_all(crcs);
  CHECK(fault::fired() > 0);
  CHECK(st2.requeued > 0);
  fault::clear();
  CHECK_BYTES(read_file(path), want);
  CHECK_POOL_FULL(eng);
}

TEST(read_ranges_returns_the_crc32_of_each_range_that_asks, ALL) {
  // Every way a range is read: direct bodies split into buffer-sized jobs with
  // a staged tail, staged ranges spanning several windows, many small ranges
  // coalesced into shared windows, overlapping and empty ranges; some ask for
  // a CRC, some do not. Each CRC must equal the CRC of the bytes delivered.
  EngineConfig cfg = config();
  cfg.buffer_size = 1u << 20;  // more windows and direct jobs per range
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (7u << 20) + 12345;
  std::string data = random_bytes(n, 41);
  std::string path = dir.file("crc.bin");
  save(eng, path, data);

  std::mt19937_64 rng(42);
  struct Want {
    size_t off, len;
    bool crc;
  };
  std::vector<Want> spans = {
      {0, n, true},                           // the whole file: direct body, staged tail
      {4096, 3 * cfg.buffer_size, true},      // aligned: direct only, 3 jobs
      {4096 * 7 + 1, (2u << 20) + 5, true},   // unaligned: staged over 3 windows
      {n - 1, 1, true},
      {100, 0, true},                         // empty: CRC 0
      {5000, 777, false},
  };
  size_t off = 3;
  while (spans.size() < 400 && off < n) {  // small ranges, coalesced, some asking, some not
    size_t len = std::min<size_t>(n - off, 1 + rng() % 5000);
    spans.push_back({off, len, rng() % 4 != 0});
    off += len + rng() % 9000;
  }
  for (int i = 0; i < 40; ++i) {  // large, random, overlapping
    size_t len = rng() % (3u << 20);
    size_t o = rng() % (n - len + 1);
    if (rng() % 2) o &= ~size_t(4095);
    spans.push_back({o, len, true});
  }
  std::shuffle(spans.begin(), spans.end(), rng);
  std::vector<std::unique_ptr<AlignedBuf>> bufs;
  std::vector<uint32_t> crcs(spans.size(), 0xdeadbeefu);
  std::vector<ReadRange> rs;
  for (size_t i = 0; i < spans.size(); ++i) {
    // aligned destinations (direct reads where the offset allows), some shifted by one byte
    bufs.emplace_back(new AlignedBuf(spans[i].len + 1));
    char* dst = bufs.back()->p + (rng() % 3 == 0 ? 1 : 0);
    rs.push_back(ReadRange{dst, spans[i].len, spans[i].off, spans[i].crc ? &crcs[i] : nullptr});
  }
  evict(path);  // the disk path: read_ranges copies cached bytes from the page cache
  ReadStats st = fastckpt::read_ranges(eng, path, rs);
  if (cfg.direct) CHECK(st.direct_requests > 0);
  CHECK(st.requests > st.direct_requests);
  for (size_t i = 0; i < spans.size(); ++i) {
    const std::string got(static_cast<char*>(rs[i].dst), spans[i].len);
    CHECK_BYTES(got, data.substr(spans[i].off, spans[i].len));
    const std::string what = "range " + std::to_string(spans[i].off) + "+" + std::to_string(spans[i].len);
    if (spans[i].crc)
      CHECK_MSG(crcs[i] == fastckpt::crc32(0, data.data() + spans[i].off, spans[i].len), what);
    else
      CHECK_MSG(crcs[i] == 0xdeadbeefu, what + ": no CRC asked, none written");
  }
  CHECK_POOL_FULL(eng);
}

TEST(empty_file_and_empty_reads, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  std::string path = dir.file("empty.bin");
  WriteStats st = save(eng, path, "");
  CHECK_EQ(st.bytes, 0u);
  CHECK_EQ(st.requests, 0u);
  CHECK_EQ(file_size(path), 0);
  ReadStats rs = fastckpt::read_ranges(eng, path, {});
  CHECK_EQ(rs.bytes, 0u);
  CHECK_EQ(rs.requests, 0u);
  char x = 'x';
  rs = fastckpt::read_ranges(eng, path, {{&x, 0, 0}});
  CHECK_EQ(rs.bytes, 0u);
  CHECK_EQ(x, 'x');
  CHECK_THROWS(TruncatedError, fastckpt::read_ranges(eng, path, {{&x, 1, 0}}));
  CHECK_POOL_FULL(eng);
}

TEST(overwrite_replaces_the_file_atomically, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  std::string path = dir.file("ckpt.pt");
  std::string v1 = random_bytes(300000, 1), v2 = random_bytes(1234, 2);
  save(eng, path, v1);
  {
    Writer w(eng, path, -1);
    w.append(v2.data(), v2.size());
    // Until commit the old file is intact and the new data sits in a temporary
    // file in the same directory.
    CHECK_BYTES(read_file(path), v1);
    CHECK_EQ(temp_files(dir.path()).size(), 1u);
    CHECK_EQ(fastckpt::sys::dirname(w.tmp_path()), dir.path());
    CHECK_CONTAINS(w.tmp_path(), ".fastckpt-tmp.");
    CHECK_CONTAINS(w.tmp_path(), "/.fastckpt-tmp." + fastckpt::temp_key("ckpt.pt") + ".");
    w.commit();
  }
  CHECK_BYTES(read_file(path), v2);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_EQ(list_dir(dir.path()).size(), 1u);
}

TEST(preallocation_and_flush_interval_keep_exact_size, ALL) {
  EngineConfig cfg = config();
  cfg.flush_interval = 100u << 10;
  TempDir dir;
  Engine eng(cfg);
  const size_t n = (1u << 20) + 99;
  std::string data = random_bytes(n, 8);
  // Expected size exact, too large and too small.
  for (int64_t expected : {static_cast<int64_t>(n), static_cast<int64_t>(3 * n), static_cast<int64_t>(n / 3),
                           static_cast<int64_t>(0)}) {
    std::string path = dir.file("p" + std::to_string(expected) + ".bin");
    save(eng, path, data, 50000, expected);
    CHECK_EQ(file_size(path), static_cast<int64_t>(n));
    CHECK_BYTES(read_file(path), data);
  }
  cfg.preallocate = false;
  Engine eng2(cfg);
  std::string path = dir.file("noprealloc.bin");
  save(eng2, path, data, 0, static_cast<int64_t>(n));
  CHECK_BYTES(read_file(path), data);
  CHECK_POOL_FULL(eng);
  CHECK_POOL_FULL(eng2);
}

TEST(repeated_saves_leak_no_descriptors_or_buffers, ALL) {
  EngineConfig cfg = config();
  TempDir dir;
  Engine eng(cfg);
  std::string path = dir.file("again.bin");
  save(eng, path, random_bytes(1000, 0));  // the first save creates the backend
  size_t fds = count_fds();
  for (int i = 0; i < 20; ++i) {
    std::string d = random_bytes(1000 + 5000 * i, i);
    save(eng, path, d);
    CHECK_BYTES(load(eng, path, d.size()), d);
  }
  CHECK_EQ(count_fds(), fds);
  CHECK_POOL_FULL(eng);
  CHECK_NO_TEMP_FILES(dir.path());
}

TEST(concurrent_writers_share_one_engine, ALL) {
  // 6 threads x queue depth 4 against a pool of 4 buffers: writers and
  // readers contend for staging buffers and backends.
  EngineConfig cfg = config(64u << 10, 4, 4);
  TempDir dir;
  Engine eng(cfg);
  const int kThreads = 6, kFiles = 3;
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
        for (int f = 0; f < kFiles; ++f) {
          size_t n = 1 + (static_cast<size_t>(t) * 7919 + static_cast<size_t>(f) * 104729) * 3 % (700u << 10);
          std::string data = random_bytes(n, static_cast<uint64_t>(t * 100 + f));
          std::string path = dir.file("w" + std::to_string(t) + "_" + std::to_string(f) + ".bin");
          save(eng, path, data, 30000 + t);
          std::string got(n, '\0');
          std::vector<ReadRange> rs;
          for (size_t off = 0; off < n; off += 50000) rs.push_back({&got[off], std::min<size_t>(50000, n - off), off});
          fastckpt::read_ranges(eng, path, rs);
          if (got != data) throw std::runtime_error("engine read of " + path + " differs");
          if (read_file(path) != data) throw std::runtime_error("file " + path + " differs");
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        errors.push_back(e.what());
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        errors.push_back("thread " + std::to_string(t) + " failed");
      }
    });
  }
  for (auto& th : ts) th.join();
  if (!errors.empty()) fail(__FILE__, __LINE__, errors[0]);
  CHECK_EQ(list_dir(dir.path()).size(), static_cast<size_t>(kThreads * kFiles));
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
}

TEST(concurrent_writers_and_readers_with_a_single_staging_buffer, ALL) {
  // The smallest pool: every save and load waits for the one buffer in turn
  // (and must not deadlock).
  EngineConfig cfg = config(64u << 10, 1, 8);
  TempDir dir;
  Engine eng(cfg);
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t) {
    ts.emplace_back([&, t] {
      try {
        for (int f = 0; f < 3; ++f) {
          std::string data = random_bytes(200000 + 1000 * t + f, static_cast<uint64_t>(10 * t + f));
          std::string path = dir.file("s" + std::to_string(t) + "_" + std::to_string(f) + ".bin");
          save(eng, path, data, 7000);
          std::string got(data.size(), '\0');
          std::vector<ReadRange> rs;
          for (size_t off = 0; off < data.size(); off += 3000)
            rs.push_back({&got[off], std::min<size_t>(1000, data.size() - off), off});
          fastckpt::read_ranges(eng, path, rs);
          for (size_t off = 0; off < data.size(); off += 3000)
            if (got.compare(off, 1000, data, off, 1000) != 0) throw std::runtime_error(path + " differs");
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        errors.push_back(e.what());
      }
    });
  }
  for (auto& th : ts) th.join();
  if (!errors.empty()) fail(__FILE__, __LINE__, errors[0]);
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
}

TEST(concurrent_writer_failure_does_not_disturb_others, ALL) {
  EngineConfig cfg = config(64u << 10, 4, 4);
  TempDir dir;
  Engine eng(cfg);
  fault::Rule r = rule(fault::Op::Write, 3, EIO, 0);  // every write of the victim from the 3rd on
  r.path_contains = "victim";
  fault::arm(r);
  std::atomic<int> victim_failed{0};
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> ts;
  for (int t = 0; t < 5; ++t) {
    ts.emplace_back([&, t] {
      std::string name = t == 0 ? "victim.bin" : "ok" + std::to_string(t) + ".bin";
      std::string data = random_bytes(600000 + t, t);
      try {
        save(eng, dir.file(name), data, 40000);
        if (t == 0) throw std::runtime_error("the victim's save succeeded despite EIO");
        if (read_file(dir.file(name)) != data) throw std::runtime_error(name + " differs");
      } catch (const IoError& e) {
        if (t == 0 && e.err() == EIO) {
          ++victim_failed;
          return;
        }
        std::lock_guard<std::mutex> lk(mu);
        errors.push_back(e.what());
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        errors.push_back(e.what());
      }
    });
  }
  for (auto& th : ts) th.join();
  if (!errors.empty()) fail(__FILE__, __LINE__, errors[0]);
  CHECK_EQ(victim_failed.load(), 1);
  CHECK(!exists(dir.file("victim.bin")));
  CHECK_NO_TEMP_FILES(dir.path());
  CHECK_POOL_FULL(eng);
}

TEST(relative_path_writes_into_the_working_directory, ONCE) {
  EngineConfig cfg = config();
  TempDir dir;
  char cwd[4096];
  CHECK(::getcwd(cwd, sizeof cwd) != nullptr);
  CHECK_EQ(::chdir(dir.path().c_str()), 0);
  std::string err;
  try {
    Engine eng(cfg);
    std::string data = random_bytes(5000, 1);
    save(eng, "rel.bin", data);
    if (read_file(dir.file("rel.bin")) != data) err = "rel.bin differs";
    if (!temp_files(dir.path()).empty()) err = "temporary file left";
  } catch (const std::exception& e) {
    err = e.what();
  }
  CHECK_EQ(::chdir(cwd), 0);
  CHECK_EQ(err, std::string());
}

FCT_MAIN()
