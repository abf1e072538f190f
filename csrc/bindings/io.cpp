// The writers, the range reader, the CRC-32 and the file helpers (directory
// fsync, temporary names, the direct-I/O alignment of a file).
#include <fcntl.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "../engine/crc32.h"
#include "../engine/engine.h"
#include "../engine/reader.h"
#include "../engine/region_writer.h"
#include "../engine/sys.h"
#include "../engine/temp_file.h"
#include "../engine/writer.h"
#include "bindings.h"

namespace fastckpt {
namespace bindings {

namespace {

// A writer's statistics as a dict, in the order of the fields; a writer's
// own field (RegionStats::direct_requests, WriteStats::flush_seconds) at its
// place when given.
py::dict stats_dict(const WriteStatsBase& s, const uint64_t* direct_requests, const double* flush_seconds) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["requests"] = s.requests;
  if (direct_requests) d["direct_requests"] = *direct_requests;
  d["requeued"] = s.requeued;
  d["seconds"] = s.seconds;
  if (flush_seconds) d["flush_seconds"] = *flush_seconds;
  d["direct"] = s.direct;
  d["backend"] = s.backend;
  d["alignment"] = s.alignment;
  d["fallback"] = s.fallback;
  d["leftovers_removed"] = s.leftovers_removed;
  return d;
}

py::dict stats_dict(const WriteStats& s) {
  py::dict d = stats_dict(s, nullptr, &s.flush_seconds);
  d["borrowed_bytes"] = s.borrowed_bytes;
  return d;
}
py::dict stats_dict(const RegionStats& s) { return stats_dict(s, &s.direct_requests, nullptr); }

py::dict read_stats_dict(const ReadStats& s) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["bytes_read"] = s.bytes_read;
  d["requests"] = s.requests;
  d["direct_requests"] = s.direct_requests;
  d["vectored_requests"] = s.vectored_requests;
  d["peak_requests"] = s.peak_requests;
  d["staged_bytes"] = s.staged_bytes;
  d["cached_bytes"] = s.cached_bytes;
  d["prefaulted_bytes"] = s.prefaulted_bytes;
  d["small_paged_bytes"] = s.small_paged_bytes;
  d["seconds"] = s.seconds;
  d["direct"] = s.direct;
  d["backend"] = s.backend;
  return d;
}

// The Python objects own the engine's writers; the Engine object is kept
// alive by pybind11's keep_alive.
struct PyWriter {
  // What write_crc(..., borrow=True) lent: kept alive until commit() or
  // abort() has returned (the kernel reads it until then). Declared before
  // the writer, so that a writer destroyed uncommitted is aborted (its
  // requests reaped) before what it borrowed is let go.
  std::vector<py::object> lent;
  std::unique_ptr<Writer> w;
  Writer& get() {
    if (!w) throw py::value_error("Writer is closed");
    return *w;
  }
};

struct PyRegionWriter {
  std::unique_ptr<RegionWriter> w;
  RegionWriter& get() {
    if (!w) throw py::value_error("RegionWriter is closed");
    return *w;
  }
};

}  // namespace

namespace {

// {pid, host, start}: the fields of a temporary name that say which process wrote it.
py::dict temp_fields(const TempNameInfo& i) {
  py::dict d;
  d["pid"] = i.pid;
  d["host"] = i.host;
  d["start"] = i.start;
  return d;
}

}  // namespace

void init_io(py::module_& m) {
  py::class_<PyWriter>(m, "Writer")
      .def(py::init([](std::shared_ptr<Engine> eng, const std::string& path, int64_t expected_size) {
             py::gil_scoped_release nogil;
             return PyWriter{{}, std::unique_ptr<Writer>(new Writer(*eng, path, expected_size))};
           }),
           py::arg("engine"), py::arg("path"), py::arg("expected_size") = -1, py::keep_alive<1, 2>())
      .def("write", [](PyWriter& w, py::handle obj, bool borrow) {
             Span s(obj, false);
             Writer& wr = w.get();
             if (borrow) w.lent.push_back(py::reinterpret_borrow<py::object>(obj));
             py::gil_scoped_release nogil;
             if (borrow) wr.append_borrowed(s.ptr(), s.len());
             else wr.append(s.ptr(), s.len());
           },
           py::arg("data"), py::arg("borrow") = false,
           "Append the bytes of a contiguous CPU tensor or buffer (borrow: see write_crc).")
      .def("write_at", [](PyWriter& w, py::handle obj, uint64_t off) {
             Span s(obj, false);
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.write_at(s.ptr(), s.len(), off);
           },
           py::arg("data"), py::arg("offset"))
      .def("write_many", [](PyWriter& w, py::sequence items) {
             // Each item is data or (data, offset); one GIL release for all.
             std::vector<Span> spans;
             std::vector<int64_t> offs;
             spans.reserve(py::len(items));
             for (py::handle it : items) {
               if (py::isinstance<py::tuple>(it)) {
                 py::tuple t = py::reinterpret_borrow<py::tuple>(it);
                 if (t.size() != 2) throw py::value_error("write_many: items are data or (data, offset)");
                 int64_t off = t[1].cast<int64_t>();
                 if (off < 0)
                   throw py::value_error("write_many: negative offset " + std::to_string(off) + " in item " +
                                         std::to_string(spans.size()) + " (an item without offset is appended)");
                 spans.emplace_back(t[0], false);
                 offs.push_back(off);
               } else {
                 spans.emplace_back(it, false);
                 offs.push_back(-1);
               }
             }
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             for (size_t i = 0; i < spans.size(); ++i) {
               if (offs[i] < 0) wr.append(spans[i].ptr(), spans[i].len());
               else wr.write_at(spans[i].ptr(), spans[i].len(), static_cast<uint64_t>(offs[i]));
             }
           },
           py::arg("items"))
      .def("write_crc", [](PyWriter& w, py::handle obj, uint32_t crc, bool borrow) {
             Span s(obj, false);
             Writer& wr = w.get();
             if (borrow) w.lent.push_back(py::reinterpret_borrow<py::object>(obj));
             py::gil_scoped_release nogil;
             if (borrow) wr.append_borrowed(s.ptr(), s.len(), &crc);
             else wr.append(s.ptr(), s.len(), &crc);
             return crc;
           },
           py::arg("data"), py::arg("crc") = 0, py::arg("borrow") = false,
           "Append like write() and return the zip CRC-32 of the data, continued from `crc`. "
           "borrow=True: written straight from the data's memory where it can be (Writer::append_borrowed), "
           "which must then not change until commit() or abort() has returned; the writer keeps it alive "
           "until then.")
      .def("drain", [](PyWriter& w) {
             Writer& wr = w.get();
             try {
               without_gil([&] { wr.drain(); });
             } catch (...) {
               w.lent.clear();  // a failed drain aborted: nothing is in flight
               throw;
             }
             w.lent.clear();  // no request reads what was lent any more
           },
           "Wait until every write in flight has completed (Writer::drain): memory lent before it "
           "(write(..., borrow=True)) is read no more and may change; the file stays open.")
      .def("write_zeros", [](PyWriter& w, uint64_t n) {
             Writer& wr = w.get();
             py::gil_scoped_release nogil;
             wr.append_zeros(n);
           })
      .def_property_readonly("position", [](PyWriter& w) { return w.get().position(); })
      .def_property_readonly("direct", [](PyWriter& w) { return w.get().direct(); })
      .def_property_readonly("backend", [](PyWriter& w) { return w.get().backend_name(); })
      .def_property_readonly("path", [](PyWriter& w) { return w.get().path(); })
      .def_property_readonly("tmp_path", [](PyWriter& w) { return w.get().tmp_path(); })
      .def("commit", [](PyWriter& w) {
        Writer& wr = w.get();
        WriteStats st;
        try {
          st = without_gil([&] { return wr.commit(); });
        } catch (...) {
          w.lent.clear();  // a failed commit aborted: nothing is in flight
          throw;
        }
        w.lent.clear();
        return stats_dict(st);
      }, "Make the file durable and rename it to its final name; returns statistics.")
      .def("abort", [](PyWriter& w) {
        if (!w.w) return;
        {
          py::gil_scoped_release nogil;
          w.w->abort();
        }
        w.lent.clear();
      }, "Discard the temporary file (no effect after commit).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyWriter& w, py::object, py::object, py::object) {
        if (!w.w) return false;
        {
          py::gil_scoped_release nogil;
          w.w->abort();  // a Writer left without commit() is discarded
        }
        w.lent.clear();
        return false;
      });

  py::class_<PyRegionWriter>(m, "RegionWriter")
      .def(py::init([](std::shared_ptr<Engine> eng, const std::string& target, const std::string& tmp, bool create,
                       uint64_t size) {
             py::gil_scoped_release nogil;
             return PyRegionWriter{std::unique_ptr<RegionWriter>(new RegionWriter(*eng, target, tmp, create, size))};
           }),
           py::arg("engine"), py::arg("target"), py::arg("tmp") = "", py::arg("create") = false, py::arg("size") = 0,
           py::keep_alive<1, 2>(),
           "One process's part of a file written by several (region_writer.h): create=True makes the temporary "
           "file of `target`, `size` bytes long (tmp_path names it); otherwise opens the existing temporary file "
           "`tmp`.")
      .def("write_at", [](PyRegionWriter& w, py::handle obj, uint64_t off, bool crc) -> py::object {
             Span s(obj, false);
             RegionWriter& wr = w.get();
             uint32_t c = 0;
             {
               py::gil_scoped_release nogil;
               wr.write_at(s.ptr(), s.len(), off, crc ? &c : nullptr);
             }
             if (!crc) return py::none();
             return py::int_(c);
           },
           py::arg("data"), py::arg("offset"), py::arg("crc") = false,
           "Write the bytes of a contiguous CPU tensor or buffer at `offset`; with crc=True return their zip CRC-32.")
      .def("finish", [](PyRegionWriter& w) {
             RegionWriter& wr = w.get();
             return stats_dict(without_gil([&] { return wr.finish(); }));
           },
           "Reap every write and fdatasync the file.")
      .def("commit", [](PyRegionWriter& w) {
             RegionWriter& wr = w.get();
             return stats_dict(without_gil([&] { return wr.commit(); }));
           },
           "The creator only: finish(), rename over the target, fsync the directory.")
      .def("abort", [](PyRegionWriter& w) {
             if (!w.w) return;
             py::gil_scoped_release nogil;
             w.w->abort();
           },
           "Stop: reap what is in flight; the creator removes the temporary file.")
      .def_property_readonly("tmp_path", [](PyRegionWriter& w) { return w.get().tmp_path(); })
      .def_property_readonly("target", [](PyRegionWriter& w) { return w.get().target(); })
      .def_property_readonly("owner", [](PyRegionWriter& w) { return w.get().owner(); })
      .def_property_readonly("direct", [](PyRegionWriter& w) { return w.get().direct(); })
      .def_property_readonly("backend", [](PyRegionWriter& w) { return w.get().backend_name(); });

  m.attr("READ_COALESCE_GAP") = py::int_(kCoalesceGap);
  m.def("read_ranges", [](std::shared_ptr<Engine> eng, const std::string& path, py::sequence items, int fd,
                          bool crc, py::sequence fill, bool fresh_huge) {
          // Each item: (destination, file_offset[, want_crc]); the whole destination is filled.
          const size_t n = py::len(items);
          std::vector<Span> spans;
          std::vector<ReadRange> ranges;
          std::vector<uint32_t> crcs(n, 0);
          std::vector<char> want(n, 0);
          bool any_crc = false;
          spans.reserve(n);
          ranges.reserve(n);
          for (py::handle it : items) {
            const size_t i = ranges.size();
            py::tuple t = py::cast<py::tuple>(it);
            if (t.size() != 2 && t.size() != 3)
              throw py::value_error("read_ranges: items are (destination, offset) or (destination, offset, crc)");
            int64_t off = t[1].cast<int64_t>();
            if (off < 0) throw py::value_error("read_ranges: negative offset");
            want[i] = t.size() == 3 ? t[2].cast<bool>() : crc;
            any_crc = any_crc || want[i];
            spans.emplace_back(t[0], true);
            ranges.push_back(ReadRange{spans.back().ptr(), spans.back().len(), static_cast<uint64_t>(off),
                                       want[i] ? &crcs[i] : nullptr});
          }
          // Each fill item: (buffer, file_offset), a buffer laid out as the file is from that offset:
          // its bytes that no item's destination covers are read too (without a CRC). An item inside
          // it must sit where the file puts it, so that no byte is read twice.
          std::vector<Span> blocks;
          std::vector<ReadRange> gaps;
          std::vector<const ReadRange*> by_dst;  // the non-empty items, by destination
          if (py::len(fill)) {
            for (const ReadRange& r : ranges)
              if (r.len) by_dst.push_back(&r);
            std::sort(by_dst.begin(), by_dst.end(),
                      [](const ReadRange* x, const ReadRange* y) { return x->dst < y->dst; });
          }
          blocks.reserve(py::len(fill));
          for (py::handle it : fill) {
            py::tuple t = py::cast<py::tuple>(it);
            if (t.size() != 2) throw py::value_error("read_ranges: fill items are (buffer, offset)");
            int64_t off = t[1].cast<int64_t>();
            if (off < 0) throw py::value_error("read_ranges: negative fill offset");
            blocks.emplace_back(t[0], true);
            char* lo = blocks.back().ptr();
            char* hi = lo + blocks.back().len();
            auto first = std::lower_bound(by_dst.begin(), by_dst.end(), lo,
                                          [](const ReadRange* r, char* p) { return static_cast<char*>(r->dst) < p; });
            if (first != by_dst.begin() && static_cast<char*>((*(first - 1))->dst) + (*(first - 1))->len > lo)
              throw py::value_error("read_ranges: an item overlaps the start of a fill buffer");
            char* at = lo;  // the buffer's bytes before this are covered
            auto gap = [&](char* to) {
              if (to > at)
                gaps.push_back(ReadRange{at, static_cast<uint64_t>(to - at),
                                         static_cast<uint64_t>(off) + static_cast<uint64_t>(at - lo), nullptr});
            };
            for (auto r = first; r != by_dst.end() && static_cast<char*>((*r)->dst) < hi; ++r) {
              char* p = static_cast<char*>((*r)->dst);
              if (p + (*r)->len > hi || static_cast<uint64_t>(p - lo) + static_cast<uint64_t>(off) != (*r)->off)
                throw py::value_error("read_ranges: an item inside a fill buffer is not where the file puts it");
              if (p < at) throw py::value_error("read_ranges: items inside a fill buffer overlap");
              gap(p);
              at = p + (*r)->len;
            }
            gap(hi);
          }
          ranges.insert(ranges.end(), gaps.begin(), gaps.end());
          py::dict d = read_stats_dict(without_gil([&] { return read_ranges(*eng, path, ranges, fd, fresh_huge); }));
          if (any_crc) {
            py::list out(n);
            for (size_t i = 0; i < n; ++i) out[i] = want[i] ? py::object(py::int_(crcs[i])) : py::object(py::none());
            d["crcs"] = out;
          }
          return d;
        },
        py::arg("engine"), py::arg("path"), py::arg("ranges"), py::arg("fd") = -1, py::arg("crc") = false,
        py::arg("fill") = py::tuple(), py::arg("fresh_huge") = false,
        "Fill each (destination, offset) from the file with parallel reads; with fd, from the file that open "
        "descriptor refers to (consistent with what was read through it, even if path is renamed over meanwhile). "
        "With crc=True (every item) or an item (destination, offset, True), the engine also computes the zip "
        "CRC-32 of each such destination's bytes as they land, in parallel with the reads: the returned dict's "
        "'crcs' holds one per item (None for items that did not ask). Each fill item (buffer, offset), a buffer "
        "laid out as the file is from that offset, has its bytes that no item covers read in the same batch "
        "(the items inside it must lie where the file puts them). fresh_huge=True: the destinations were "
        "allocated for this read on huge pages and nothing else maps them; where huge pages fault in slowly "
        "here, those not yet reached are advised small pages (the dict's 'small_paged_bytes') and the process "
        "remembers it (huge_pages_pay).");

  m.def("dio_alignment", [](const std::string& path) {
    int fd = sys::open(path, O_RDONLY);
    sys::DioAlign a;
    try {
      a = sys::dio_alignment(fd, path);
    } catch (...) {
      sys::close_quiet(fd);
      throw;
    }
    sys::close_quiet(fd);
    py::dict d;
    d["mem"] = a.mem;
    d["offset"] = a.offset;
    d["source"] = a.source;
    return d;
  });

  m.def("crc32", [](py::handle obj, uint32_t crc) {
          Span s(obj, false);
          if (s.len() < (64u << 10)) return crc32(crc, s.ptr(), s.len());  // less than a GIL round trip
          py::gil_scoped_release nogil;
          return crc32(crc, s.ptr(), s.len());
        },
        py::arg("data"), py::arg("crc") = 0,
        "Zip CRC-32 of a CPU tensor or buffer, continued from `crc` (equal to zlib.crc32; the GIL is released "
        "for inputs of 64 KiB and more).");
  m.def("crc32_combine", &crc32_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"),
        "The CRC-32 of a followed by b, from crc32(a), crc32(b) and len(b) (zlib's crc32_combine).");
  m.def("crc32_impl", []() { return std::string(crc32_impl()); },
        "The CRC-32 implementation of this build: 'isa-l' (hardware-accelerated) or 'zlib'.");
  m.def("crc32_kernel", []() { return std::string(crc32_kernel()); },
        "What crc32 runs on this CPU from 256 bytes on: 'vpclmulqdq-avx2' (the engine's own folding) or "
        "crc32_impl().");
  m.def("fsync_dir", [](const std::string& path) {
          py::gil_scoped_release nogil;
          sys::fsync_dir(path);
        },
        py::arg("path"),
        "fsync a directory (makes renames and removals in it durable) through the engine's checker and fault hook.");

  m.def("rename", [](const std::string& from, const std::string& to) {
          py::gil_scoped_release nogil;
          sys::rename(from, to);
        },
        py::arg("src"), py::arg("dst"),
        "rename(2) through the engine's checker and fault hook (Op::Rename): an OSError naming both paths.");

  m.def("rename_exchange", [](const std::string& a, const std::string& b) {
          py::gil_scoped_release nogil;
          return sys::rename_exchange(a, b);
        },
        py::arg("a"), py::arg("b"),
        "Swap two existing paths atomically (renameat2 RENAME_EXCHANGE) through the engine's checker and "
        "fault hook. False when the kernel or filesystem does not offer the exchange (EINVAL, ENOSYS, "
        "EOPNOTSUPP); any other failure raises an OSError naming both paths.");

  m.def("remove_leftovers", [](const std::string& path) {
          py::gil_scoped_release nogil;
          return remove_leftovers(path);
        },
        py::arg("path"),
        "Remove the temporary files that crashed saves of `path` left next to it (only this host's, only of dead "
        "processes, only unlocked ones; see docs/ENGINE.md); returns their names. Every Writer does this first.");
  m.def("remove_leftovers_in", [](const std::string& dir) {
          py::gil_scoped_release nogil;
          return remove_leftovers_in(dir);
        },
        py::arg("dir"),
        "remove_leftovers for the temporary files of every target in directory `dir` (the same rules); returns "
        "their names.");
  m.def("parse_temp_name", [](const std::string& entry, const std::string& target_name) -> py::object {
          TempNameInfo i;
          if (!parse_temp_name(entry, target_name, &i)) return py::none();
          return temp_fields(i);
        },
        py::arg("entry"), py::arg("target_name"),
        "The fields of a temporary file name of `target_name` ({pid, host, start}), or None.");
  m.def("temp_host", &temp_host_token, "This host's name as it appears in temporary file names.");
  m.def("temp_key", &temp_key, py::arg("name"),
        "The part of a temporary name that stands for the target name `name` (its bytes in hex, or a hash).");
  m.def("temp_name", [](const std::string& name) { return temp_path_for(name); }, py::arg("name"),
        "A new temporary name (a base name) for the target name `name`, in the engine's format.");
  m.def("parse_temp", [](const std::string& entry) -> py::object {
          TempNameInfo i;
          if (!parse_temp_entry(entry, &i)) return py::none();
          py::dict d = temp_fields(i);
          d["key"] = i.key;
          d["target"] = i.target.empty() ? py::object(py::none()) : py::object(py::str(i.target));
          return d;
        },
        py::arg("entry"),
        "The fields of a temporary name ({pid, host, start, key, target}; target None where the name holds "
        "only a hash of it), or None when `entry` is not one.");
}

}  // namespace bindings
}  // namespace fastckpt
