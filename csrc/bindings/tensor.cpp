// Tensors: the Span of a tensor or buffer (bindings.h), aligned empty
// tensors, resizable storages. The one file that includes torch's headers:
// not <torch/extension.h>, which brings in the whole C++ frontend (autograd,
// nn, optim, data) and took two thirds of the extension's compile time, but
// what is used here: pybind11 with torch's tensor casters, THPVariable,
// at::empty and the CPU allocator.
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "../engine/crc32.h"
#include "../engine/first_touch.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "bindings.h"

namespace fastckpt {
namespace bindings {

Span::Span(py::handle obj, bool writable) {
  if (THPVariable_Check(obj.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (!t.device().is_cpu())
      throw py::value_error("fastckpt._C: tensor must be on the CPU (got " + t.device().str() + ")");
    if (!t.is_contiguous()) throw py::value_error("fastckpt._C: tensor must be contiguous");
    ptr_ = static_cast<char*>(t.data_ptr());
    len_ = t.nbytes();
    return;
  }
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
  has_view_ = true;
  ptr_ = static_cast<char*>(view_.buf);
  len_ = static_cast<uint64_t>(view_.len);
}


// ------------------------------------------------------------------ arenas
//
// One block of host memory for the storages of the tensors that a load reads
// from one stretch of a file, laid out as that stretch is: the engine reads
// the stretch in large requests into memory that is contiguous and on huge
// pages (a virtio disk takes 254 segments a request: a request into 4 KiB
// pages carries 1 MiB, into huge pages its full 4 MiB), with one fault per
// 2 MiB, and no tensor's bytes are copied. Each tensor still has a storage of
// its own, of its own size (torch.save of one saves its bytes only; not
// resizable, as torch.load's are not). Its deleter gives the whole pages that
// lie inside its bytes back to the kernel (MADV_DONTNEED): pages no other
// storage uses. The block is unmapped when the last of its storages, and the
// tensor over all of it that the load reads into, is gone.
namespace {

constexpr size_t kPageSize = 4096;
constexpr size_t kHugePage = 2u << 20;

struct Arena {
  char* map = nullptr;
  size_t map_len = 0;
  std::atomic<size_t> refs{1};

  void unref() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      ::munmap(map, map_len);
      delete this;
    }
  }
};

struct ArenaPart {
  Arena* arena;
  char* begin;
  size_t len;
  bool give_back;  // a tensor's own bytes (not the whole block's)
};

void delete_arena_part(void* ctx) {
  auto* part = static_cast<ArenaPart*>(ctx);
  if (part->give_back) {
    const uintptr_t b = reinterpret_cast<uintptr_t>(part->begin);
    const uintptr_t lo = (b + kPageSize - 1) / kPageSize * kPageSize;
    const uintptr_t hi = (b + part->len) / kPageSize * kPageSize;
    if (hi > lo) (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advisory
  }
  part->arena->unref();
  delete part;
}

// A uint8 tensor over `len` bytes at `begin` of `arena` (a reference of its own).
at::Tensor arena_tensor(Arena* arena, char* begin, size_t len, bool give_back) {
  if (len == 0 && give_back) {  // an empty tensor holds no part of the block
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte));
    t.storage().unsafeGetStorageImpl()->set_resizable(false);
    return t;
  }
  arena->refs.fetch_add(1, std::memory_order_relaxed);
  auto* part = new ArenaPart{arena, begin, len, give_back};
  c10::Storage storage(c10::Storage::use_byte_size_t(), len,
                       at::DataPtr(begin, part, &delete_arena_part, at::Device(at::kCPU)), nullptr,
                       /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {static_cast<int64_t>(len)}, {1});
}

}  // namespace

void init_tensor(py::module_& m) {
  m.def("huge_pages_pay", &huge_pages_pay, py::arg("nbytes"),
        "Whether a load of nbytes should put its memory on transparent huge pages: yes from HUGE_JUDGE_MIN "
        "bytes on (a read judges those) unless a read of this process found them faulting in slower than "
        "small pages in the last minute (engine/first_touch.h).");
  m.attr("HUGE_JUDGE_MIN") = py::int_(kHugeJudgeMin);
  m.def("huge_pages_verdict", []() {
          const HugeVerdict v = huge_pages_verdict();
          py::dict d;
          d["huge"] = v.huge;
          d["slow_seen"] = v.slow_seen;
          d["bytes"] = v.bytes;
          d["cpu_s"] = v.cpu_s;
          d["age_s"] = v.age_s;
          return d;
        },
        "The process's huge-page verdict (huge_pages_pay) and the window of faults behind it.");

  m.def("empty_aligned", [](int64_t nbytes, int64_t alignment, int64_t phase, bool huge) {
          // A uint8 CPU tensor whose data starts `phase` bytes past a multiple
          // of `alignment` (torch's allocator gives 64): at phase 0 the engine
          // reads O_DIRECT straight into it; at the phase of the file offset
          // its bytes come from (a file whose tensors are not aligned), the
          // aligned body of the range. The storage stays resizable: a resize
          // allocates through torch's CPU allocator and frees this block with
          // free().
          if (nbytes < 0) throw py::value_error("empty_aligned: negative size");
          if (alignment < 64 || (alignment & (alignment - 1)) != 0)
            throw py::value_error("empty_aligned: alignment must be a power of two >= 64");
          if (phase < 0 || phase >= alignment)
            throw py::value_error("empty_aligned: phase must lie in [0, alignment)");
          void* p = nullptr;
          const size_t n = static_cast<size_t>(phase) + (nbytes > 0 ? static_cast<size_t>(nbytes) : 1);
          // Transparent huge pages (where the kernel offers them for madvised memory): a block of
          // 2 MiB or more starts on a huge page and is advised MADV_HUGEPAGE, so that an O_DIRECT
          // transfer from or into it has a few physically contiguous 2 MiB segments per request
          // instead of one per 4 KiB page (a virtio disk takes 254 segments a request: 1 MiB of
          // small pages), and its first touch backs 2 MiB per fault.
          constexpr size_t kHuge = 2u << 20;
          const bool thp = huge && n >= kHuge;
          const size_t align = thp && static_cast<size_t>(alignment) < kHuge ? kHuge : static_cast<size_t>(alignment);
          if (posix_memalign(&p, align, n) != 0) throw std::bad_alloc();
          if (thp) (void)::madvise(p, n / kHuge * kHuge, MADV_HUGEPAGE);  // advisory; whole huge pages only
          c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                               at::DataPtr(static_cast<char*>(p) + phase, p, &std::free, at::Device(at::kCPU)),
                               c10::GetAllocator(at::kCPU), /*resizable=*/true);
          return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
        },
        py::arg("nbytes"), py::arg("alignment") = 4096, py::arg("phase") = 0, py::arg("huge") = false,
        "An uninitialized uint8 CPU tensor of nbytes whose data starts `phase` bytes past a "
        "multiple of `alignment` (for reads straight into it with O_DIRECT); its storage is resizable like "
        "torch.empty's. huge=True: a block of 2 MiB or more starts on a 2 MiB boundary and is advised "
        "MADV_HUGEPAGE (transparent huge pages).");

  m.def("empty_arena", [](int64_t nbytes, int64_t phase, const std::vector<std::pair<int64_t, int64_t>>& spans,
                          bool huge) {
          // See "arenas" above. The block starts `phase` bytes past a page (past a huge
          // page with `huge`): at the phase of the file offset it is read from, so that
          // the engine reads its aligned body O_DIRECT straight into it.
          if (nbytes < 0) throw py::value_error("empty_arena: negative size");
          if (phase < 0 || phase >= static_cast<int64_t>(kPageSize))
            throw py::value_error("empty_arena: phase must lie in [0, 4096)");
          int64_t prev = 0;
          for (const auto& sp : spans) {
            if (sp.first < prev || sp.second < sp.first || sp.second > nbytes)
              throw py::value_error("empty_arena: spans must be in order, not overlap, and lie within the block");
            prev = sp.second;
          }
          const size_t align = huge ? kHugePage : kPageSize;
          const size_t len = static_cast<size_t>(phase) + static_cast<size_t>(nbytes);
          const size_t want = (len + kPageSize - 1) / kPageSize * kPageSize + (huge ? align : 0);
          void* m = ::mmap(nullptr, want > 0 ? want : kPageSize, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (m == MAP_FAILED) throw std::bad_alloc();
          auto* arena = new Arena;
          arena->map = static_cast<char*>(m);
          arena->map_len = want > 0 ? want : kPageSize;
          char* base = arena->map;
          if (huge) {
            base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + align - 1) / align * align);
            const size_t whole = (len + kPageSize - 1) / kPageSize * kPageSize / kHugePage * kHugePage;
            if (whole > 0) (void)::madvise(base, whole, MADV_HUGEPAGE);  // advisory; whole huge pages only
          }
          char* data = base + phase;
          py::list parts;
          at::Tensor all;
          try {
            all = arena_tensor(arena, data, static_cast<size_t>(nbytes), false);
            for (const auto& sp : spans)
              parts.append(arena_tensor(arena, data + sp.first, static_cast<size_t>(sp.second - sp.first), true));
          } catch (...) {
            arena->unref();
            throw;
          }
          arena->unref();  // the tensors hold it now
          return py::make_tuple(all, parts);
        },
        py::arg("nbytes"), py::arg("phase"), py::arg("spans"), py::arg("huge") = true,
        "One block of nbytes of uninitialized host memory starting `phase` bytes past a page (with huge: a "
        "2 MiB page, advised MADV_HUGEPAGE): (a uint8 tensor over all of it, [a uint8 tensor per (begin, end) "
        "span, each with a storage of its own, not resizable]). A span's whole pages go back to the kernel "
        "when its storage dies; the block is unmapped when every tensor over it is gone.");

  m.def("copy_bytes", [](py::handle dst, py::handle src) {
          // memcpy on this thread, without the GIL: torch's copy_ of a host tensor of more than
          // 32768 elements runs on its intra-op thread pool, whose start and wake-ups (milliseconds
          // on a machine whose CPUs the training loop keeps busy) dwarf the copy of a small one.
          Span d(dst, true), s(src, false);
          if (d.len() != s.len())
            throw py::value_error("copy_bytes: " + std::to_string(d.len()) + " bytes cannot hold " +
                                  std::to_string(s.len()));
          py::gil_scoped_release nogil;
          if (s.len()) std::memcpy(d.ptr(), s.ptr(), s.len());
        },
        py::arg("dst"), py::arg("src"),
        "Copy the bytes of contiguous CPU tensor (or buffer) `src` into `dst` of the same size, on the "
        "calling thread, without the GIL.");

  m.def("copy_crc32_many", [](py::sequence dsts, py::sequence srcs, unsigned threads) {
          const size_t n = py::len(dsts);
          if (py::len(srcs) != n) throw py::value_error("copy_crc32_many: as many sources as destinations");
          std::vector<Span> d, s;
          d.reserve(n);
          s.reserve(n);
          std::vector<char*> dp(n);
          std::vector<const char*> sp(n);
          std::vector<uint64_t> len(n);
          for (size_t i = 0; i < n; ++i) {
            d.emplace_back(dsts[i], true);
            s.emplace_back(srcs[i], false);
            if (d[i].len() != s[i].len())
              throw py::value_error("copy_crc32_many: destination " + std::to_string(i) + " has " +
                                    std::to_string(d[i].len()) + " bytes, its source " + std::to_string(s[i].len()));
            dp[i] = d[i].ptr();
            sp[i] = s[i].ptr();
            len[i] = d[i].len();
          }
          std::vector<uint32_t> crc(n);
          {
            py::gil_scoped_release nogil;
            fastckpt::copy_crc32_many(dp.data(), sp.data(), len.data(), n, crc.data(), threads);
          }
          return crc;
        },
        py::arg("dsts"), py::arg("srcs"), py::arg("threads") = 1,
        "Copy each contiguous CPU source into its destination of the same size and return the zip CRC-32 "
        "of each, in one pass (each 256 KiB folded right after its copy), on `threads` threads (the "
        "caller's and threads - 1 more), without the GIL.");

  m.def("set_resizable", [](const at::Tensor& t, bool resizable) {
          // torch.load's storages are not resizable: a tensor that a damaged pickle
          // stretches past its record (set_ with a larger size) is then torch's error,
          // not a reallocation of memory the engine may still be reading into.
          t.storage().unsafeGetStorageImpl()->set_resizable(resizable);
        },
        py::arg("tensor"), py::arg("resizable"),
        "Make the storage of `tensor` resizable or not (torch.load's storages are not).");
}

}  // namespace bindings
}  // namespace fastckpt
