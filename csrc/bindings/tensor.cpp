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

#include <vector>

#include "../engine/crc32.h"

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

void init_tensor(py::module_& m) {
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
