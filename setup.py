"""Build fastckpt and its C++ extension (fastckpt._C).

The engine's sources (csrc/engine/) and the pickle scanner's (csrc/pickle/)
are taken by glob, as CMakeLists.txt does. io_uring support is compiled in when liburing's headers and library are
found (Debian: liburing-dev); otherwise the build says so and the engine uses
its thread backend only. The CRC-32 is ISA-L's (crc32_gzip_refl) when its
header and library are found (Debian: libisal-dev; FASTCKPT_NO_ISAL=1 skips
it), else zlib's; ``fastckpt._C.crc32_impl()`` says which. DEBUG=1 builds
with -O0 -g.

The distribution is named ``fastckpt-io`` (the name "fastckpt" on PyPI is an
unrelated project); the import name and the command are ``fastckpt``. The
version's one source is ``__version__`` in fastckpt/__init__.py.

FASTCKPT_BUILD_EXT=0 leaves the extension out: .ci/setup.sh uses it for the
editable install and then builds the extension once, in place, with
``setup.py build_ext --inplace`` (what ``make build`` reruns incrementally).
A package built with it set has no engine and fails at ``import fastckpt``.

FASTCKPT_SANITIZE=address,undefined (a comma list, passed to -fsanitize=)
builds the extension with sanitizers: -fsanitize=<list> -fno-omit-frame-pointer
-fno-sanitize-recover=undefined -O1 -g, on both the compile and the link line.
Python itself is not instrumented, so such an extension only imports with the
sanitizer runtime preloaded (LD_PRELOAD); tests/fuzz/run_sanitized.sh builds one
out of tree and runs the fuzzers against it. Never build it in place.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    """__version__ from fastckpt/__init__.py, read as text (importing it needs the built extension)."""
    with open(os.path.join(ROOT, "fastckpt", "__init__.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not m:
        raise RuntimeError("fastckpt/__init__.py has no __version__ line")
    return m.group(1)


def _links(src: str, lib: str) -> bool:
    """Whether the C program `src` compiles and links with -l`lib` (the probe of an optional library)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    with tempfile.TemporaryDirectory() as d:
        c = os.path.join(d, "t.c")
        with open(c, "w") as f:
            f.write(src)
        return subprocess.run([cc, c, "-o", os.path.join(d, "t"), "-l" + lib], capture_output=True).returncode == 0


def _find_liburing():
    """Return True when a tiny program using liburing compiles and links."""
    if os.environ.get("FASTCKPT_NO_URING") == "1":
        print("fastckpt: FASTCKPT_NO_URING=1, building without io_uring", file=sys.stderr)
        return False
    # liburing >= 2.2 (io_uring_sqe_set_data64); an older one counts as absent.
    src = ("#include <liburing.h>\nint main(void){struct io_uring r; struct io_uring_sqe* s = 0;\n"
           "if (s) io_uring_sqe_set_data64(s, 1); return io_uring_queue_init(1,&r,0) < -1000;}\n")
    if not _links(src, "uring"):
        print("fastckpt: liburing >= 2.2 not found (install liburing-dev): building with the thread backend only",
              file=sys.stderr)
        return False
    return True


def _find_isal():
    """Return True when a tiny program calling ISA-L's crc32_gzip_refl compiles and links."""
    if os.environ.get("FASTCKPT_NO_ISAL") == "1":
        print("fastckpt: FASTCKPT_NO_ISAL=1, CRC-32 from zlib", file=sys.stderr)
        return False
    src = ("#include <isa-l/crc.h>\nint main(void){static const unsigned char b[1];\n"
           "return (int)(crc32_gzip_refl(0, b, 0) & 1);}\n")
    if not _links(src, "isal"):
        print("fastckpt: ISA-L not found (install libisal-dev): CRC-32 from zlib", file=sys.stderr)
        return False
    return True


def _extension():
    sources = sorted(glob.glob(os.path.join("csrc", "engine", "*.cc")))
    sources += sorted(glob.glob(os.path.join("csrc", "pickle", "*.cc")))
    sources += sorted(glob.glob(os.path.join("csrc", "bindings", "*.cpp")))
    debug = os.environ.get("DEBUG") == "1"
    cxx = ["-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # Python's own flags carry -g: with torch's headers that is a 23 MB object for the bindings and a quarter
    # of their compile time. Release builds have no debug information (DEBUG=1 and sanitized builds do).
    cxx += ["-O0", "-g"] if debug else ["-O2", "-g0"]
    link = []
    sanitize = os.environ.get("FASTCKPT_SANITIZE", "").strip()
    if sanitize:
        san = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-O1", "-g"]
        cxx += san  # the last -O wins: -O1 replaces -O2 / -O0
        link += san
        print(f"fastckpt: FASTCKPT_SANITIZE={sanitize}: building with {' '.join(san)}", file=sys.stderr)
    macros, libs = [], ["z"]  # zlib: the zip CRC-32
    if _find_liburing():
        macros.append(("FASTCKPT_HAVE_URING", "1"))
        libs.append("uring")
    if _find_isal():
        macros.append(("FASTCKPT_HAVE_ISAL", "1"))
        libs.append("isal")
    return CppExtension(
        name="fastckpt._C",
        sources=sources,
        define_macros=macros,
        libraries=libs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


setup(
    name="fastckpt-io",
    version=_version(),
    description="Fast, durable, atomic PyTorch checkpoint I/O (O_DIRECT + io_uring)",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fastckpt", "fastckpt.*"]),
    package_data={"fastckpt": ["_C.pyi", "py.typed"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.6", "numpy", "tqdm"],
    extras_require={
        # fastckpt.remote (s3://, gs:// URLs; file:// needs only fsspec, which comes with torch)
        "s3": ["s3fs>=2024.6"],
        "gcs": ["gcsfs>=2024.6"],
        # framework integrations: fastckpt.integrations.*, tested at the pinned versions
        # of requirements-dev.txt
        "lightning": ["lightning>=2.6,<2.7"],
        "accelerate": ["accelerate>=1.15,<2", "safetensors"],
        "transformers": ["transformers>=5.24,<6", "accelerate>=1.15,<2", "safetensors"],
        "deepspeed": ["deepspeed>=0.19.8,<0.20"],
        # not in "all": a full resolve of torchtitan 0.3 pulls datasets<4.8, which wants an older huggingface_hub
        # than transformers 5.24 and an older fsspec (docs/INTEGRATIONS.md; tests: .ci/install_torchtitan.sh)
        "torchtitan": ["torchtitan>=0.3,<0.4"],
        "all": ["s3fs>=2024.6", "lightning>=2.6,<2.7", "accelerate>=1.15,<2", "transformers>=5.24,<6", "safetensors",
                "deepspeed>=0.19.8,<0.20"],
    },
    entry_points={"console_scripts": ["fastckpt = fastckpt.cli:main"]},
    ext_modules=[] if os.environ.get("FASTCKPT_BUILD_EXT") == "0" else [_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
