"""A filesystem of a test's own: ext4 on a loop device over a sparse file, mounted under the test's
directory, with the byte count the device has read. Reads counted there are this filesystem's and
nobody else's: /proc/self/io's read_bytes also counts the pages of code and modules a process
faults in, which a concurrent `echo 3 > /proc/sys/vm/drop_caches` (the benchmarks' tests drop the
whole page cache) turns into megabytes of reads that are not the checkpoint's.

`loop_ext4(dir, size)` is a context manager yielding a LoopFs, or raising LoopFsUnavailable with
the reason (not root, no loop devices, a tool missing) for the caller to skip with."""
import contextlib
import ctypes
import os
import shutil
import subprocess
from typing import Optional


class LoopFsUnavailable(Exception):
    pass


class LoopFs:
    def __init__(self, mount: str, dev: str):
        self.mount, self.dev = mount, dev
        self._stat = os.path.join("/sys/block", os.path.basename(dev), "stat")

    def read_bytes(self) -> int:
        """Bytes the block device has read since it was attached (sectors of 512 bytes)."""
        with open(self._stat) as f:
            return int(f.read().split()[2]) * 512


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise LoopFsUnavailable(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip() or p.returncode}")
    return p.stdout.strip()


@contextlib.contextmanager
def loop_ext4(parent, size: int = 128 << 20, read_ahead_kb: int = 8192):
    """`read_ahead_kb` is set on the loop device (a loop device's own default is 128): 8192, as
    this VM's disk has, makes a readahead that should not happen show as megabytes."""
    if os.geteuid() != 0:
        raise LoopFsUnavailable("not root: attaching a loop device and mounting need root")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise LoopFsUnavailable(f"{tool} not found")
    if not os.path.exists("/dev/loop-control"):
        raise LoopFsUnavailable("no /dev/loop-control (no loop devices here)")
    img, mnt = os.path.join(parent, "loopfs.img"), os.path.join(parent, "loopfs")
    with open(img, "wb") as f:
        f.truncate(size)
    dev = _run(["losetup", "--find", "--show", img])
    mounted = False
    try:
        with open(os.path.join("/sys/block", os.path.basename(dev), "queue", "read_ahead_kb"), "w") as f:
            f.write(str(read_ahead_kb))
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev])
        os.makedirs(mnt, exist_ok=True)
        _run(["mount", "-o", "noatime", dev, mnt])
        mounted = True
        yield LoopFs(mnt, dev)
    finally:
        if mounted and subprocess.run(["umount", mnt], capture_output=True).returncode:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        with contextlib.suppress(OSError):
            os.unlink(img)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_bytes(path) -> Optional[int]:
    """How many bytes of `path` are in the page cache now (cachestat(2), Linux 6.5+; pages of 4 KiB
    counted whole), or None where the kernel cannot say."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        rng, st = _Range(0, 0), _Stat()
        if libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return None
        return st.cache * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)
