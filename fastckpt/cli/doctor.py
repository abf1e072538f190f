"""``fastckpt doctor``: what this machine and a directory support, and what fastckpt will use there.

Every fact comes from a probe, not from a guess: a small engine is made with the
current knobs (io_uring or the thread backend, and the kernel's refusal if any),
a temporary file is opened in the directory through the engine's Writer
(O_DIRECT or buffered; removed again), ``statfs`` gives the filesystem's magic
number and ``/proc/self/mounts`` its mount entry. The memory tier's directory is
looked at the same way and scanned (:func:`fastckpt.memory.stale.scan`) for
namespaces whose processes are gone. Nothing is left behind.
"""

import ctypes
import ctypes.util
import errno
import os
import platform
import resource
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import knobs
from .._core import probe
from .._core.units import human

# statfs(2) f_type values (linux/magic.h and filesystems' own headers)
FS_MAGIC = {
    0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs", 0x858458F6: "ramfs",
    0x6969: "nfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x65735546: "fuse", 0x794C7630: "overlayfs",
    0x2FC12FC1: "zfs", 0xF2F52010: "f2fs", 0x00C36400: "ceph", 0x0BD00BD0: "lustre", 0x47504653: "gpfs",
    0x01021997: "9p/v9fs", 0x4D44: "vfat", 0x2011BAB0: "exfat", 0xCA451A4E: "bcachefs", 0x5346544E: "ntfs",
    0x62656572: "sysfs", 0x9FA0: "proc", 0x73717368: "squashfs", 0x3153464A: "jfs", 0x52654973: "reiserfs",
    0x6E736673: "nsfs", 0x19830326: "fhgfs/beegfs", 0x6B414653: "afs", 0x5A3C69F0: "aufs",
}
MEMORY_FS = {"tmpfs", "ramfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb2", "smb3", "ceph", "lustre", "gpfs", "9p", "9p/v9fs", "fhgfs/beegfs",
              "afs", "beegfs"}
LOW_FREE = 10 << 30   # below this, a warning: a save needs room for the new file next to the old one


def _statfs_magic(path: str) -> Optional[int]:
    """f_type of statfs(2), or None where it cannot be called."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def _mount_of(path: str) -> Optional[Dict[str, str]]:
    """The /proc/self/mounts entry whose mount point holds `path` (the longest match)."""
    real = os.path.realpath(path)
    best = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if real == mnt or real.startswith(mnt.rstrip("/") + "/") or mnt == "/":
                    if best is None or len(mnt) >= len(best["mount_point"]):
                        best = {"device": parts[0], "mount_point": mnt, "type": parts[2], "options": parts[3]}
    except OSError:
        return None
    return best


def _io_uring(choice: Dict[str, Any]) -> Dict[str, Any]:
    """Whether io_uring works here: what the engine of the current knobs found when
    they say auto, else a probe engine of its own."""
    out: Dict[str, Any] = {"compiled": probe.uring_compiled()}
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            out["kernel_io_uring_disabled"] = int(f.read().strip())
    except (OSError, ValueError):
        out["kernel_io_uring_disabled"] = None
    try:
        if knobs.config().backend == "auto" and choice.get("backend"):
            backend, refusal = choice["backend"], choice.get("refusal")
        else:
            backend, refusal = probe.probe_backend("auto")
        out["usable"] = backend == "io_uring"
        out["refusal"] = refusal or None
        if not out["compiled"]:
            out["refusal"] = "fastckpt was built without liburing"
        elif not out["usable"] and not out["refusal"]:
            out["refusal"] = "unknown"
    except OSError as e:
        out["usable"] = False
        out["refusal"] = str(e)
    disabled = out["kernel_io_uring_disabled"]
    if not out["usable"] and disabled:
        out["hint"] = (f"kernel.io_uring_disabled = {disabled} (sysctl -w kernel.io_uring_disabled=0 enables it"
                       + (" for everyone" if disabled == 2 else "; 1 allows only the io_uring_group") + ")")
    elif not out["usable"] and out["compiled"] and "Operation not permitted" in (out["refusal"] or ""):
        out["hint"] = "a seccomp profile (e.g. a container runtime's default) forbids io_uring_setup"
    return out


def _engine_choice() -> Dict[str, Any]:
    """What the engine made with the current knobs uses."""
    try:
        backend, refusal = probe.probe_backend()
        return {"backend": backend, "refusal": refusal or None}
    except OSError as e:  # FASTCKPT_BACKEND=uring and io_uring refused
        return {"backend": None, "error": str(e)}


def _o_direct(directory: str) -> Dict[str, Any]:
    """Open a temporary file in `directory` through the engine and see what it chose."""
    out: Dict[str, Any] = {}
    try:
        out["alignment"] = probe.dio_alignment(directory)
    except OSError as e:
        out["alignment"] = None
        out["alignment_error"] = str(e)
    if not os.access(directory, os.W_OK | os.X_OK):
        out.update(writable=False, usable=None, reason="the directory is not writable by this user")
        return out
    out["writable"] = True
    try:
        out["usable"] = probe.direct_writes(directory)
    except OSError as e:
        out.update(usable=None, reason=f"cannot create a file there: {e}")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            out["writable"] = False
        return out
    if not out["usable"]:
        if not knobs.config().direct:
            out["reason"] = "disabled by the direct knob (FASTCKPT_DIRECT=0)"
        else:
            out["reason"] = _why_no_direct(directory)
    return out


def _why_no_direct(directory: str) -> str:
    flag = getattr(os, "O_DIRECT", 0)
    p = os.path.join(directory, f".fastckpt-doctor-odirect.{os.getpid()}")
    try:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o600)
    except OSError as e:
        return f"the filesystem refuses O_DIRECT ({os.strerror(e.errno)})"
    else:
        os.close(fd)
        return "the filesystem accepts O_DIRECT at open but refuses aligned O_DIRECT writes"
    finally:
        try:
            os.unlink(p)
        except OSError:
            pass


def _cuda() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    cuda: Dict[str, Any] = {"available": False, "torch_cuda": torch.version.cuda}
    pinned: Dict[str, Any] = {"usable": None}
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            cuda.update(available=True, devices=[torch.cuda.get_device_name(i) for i in range(n)])
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        cuda["error"] = f"{type(e).__name__}: {e}"
    if cuda["available"]:
        try:
            torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
            pinned["usable"] = True
        except Exception as e:  # noqa: BLE001
            pinned.update(usable=False, error=f"{type(e).__name__}: {e}")
    else:
        pinned["reason"] = "no CUDA device (pinned memory is used to stage CUDA tensors)"
    return cuda, pinned


def _meminfo() -> Dict[str, Optional[int]]:
    out: Dict[str, Optional[int]] = {"total": None, "available": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("MemTotal", "MemAvailable"):
                    out["total" if k == "MemTotal" else "available"] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _limit(n: int) -> Optional[int]:
    return None if n == resource.RLIM_INFINITY else n


def _filesystem(path: str) -> Dict[str, Any]:
    """The filesystem `path` is on: its type (the mount entry's, else the statfs magic's name),
    the statfs magic and its name, the mount entry."""
    magic = _statfs_magic(path)
    mount = _mount_of(path)
    fs_name = FS_MAGIC.get(magic) if magic is not None else None
    return {"type": (mount or {}).get("type") or fs_name, "statfs_magic": f"0x{magic:x}" if magic is not None else None,
            "statfs_name": fs_name, "mount": mount}


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def memory_tier(root: Optional[str] = None) -> Dict[str, Any]:
    """The memory tier's directory (``FASTCKPT_MEMORY_DIR`` or /dev/shm/fastckpt): its
    filesystem (that of the nearest existing parent when it is not made yet), free
    space, and what it holds (:func:`fastckpt.memory.stale.scan`)."""
    from ..memory import stale
    from ..memory.tier import memory_root
    root = memory_root(root)
    where = _nearest_existing(root)
    fs = _filesystem(where)
    fs_type, fs_name = fs["type"], fs["statfs_name"]
    out: Dict[str, Any] = {"directory": root, "exists": os.path.isdir(root), "filesystem": fs_type,
                           "statfs_name": fs_name,
                           "memory_fs": None if fs_type is None and fs_name is None
                           else (fs_type in MEMORY_FS or fs_name in MEMORY_FS),
                           "free": None, "total": None, "namespaces": [], "foreign": []}
    try:
        st = os.statvfs(where)
        out.update(free=st.f_bavail * st.f_frsize, total=st.f_blocks * st.f_frsize)
    except OSError as e:
        out["error"] = str(e)
    if out["exists"]:
        try:
            for e in stale.scan(root):
                if e["kind"] == "foreign":
                    out["foreign"].append({"path": e["path"], "why": e["why"]})
                else:
                    out["namespaces"].append({k: e[k] for k in ("path", "live", "bytes", "newest_step", "directories",
                                                                "ranks", "replicas", "age", "owners",
                                                                "other_files")})
        except OSError as e:
            out["error"] = str(e)
    return out


def diagnose(directory: str) -> Dict[str, Any]:
    """Everything doctor reports, as a dict (``doctor --json``)."""
    from .. import __version__
    d = os.path.abspath(directory)
    fs = _filesystem(d)
    st = os.statvfs(d)
    space = {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}
    cfg = knobs.config()
    knob_values = knobs.as_dict(cfg)
    for name in knobs.PY_NAMES:
        try:
            knob_values[name] = knobs.get(name)
        except ValueError as e:
            knob_values[name] = f"invalid: {e}"
    env = {k: v for k, v in os.environ.items() if k.startswith("FASTCKPT_")}
    cuda, pinned = _cuda()
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    choice = _engine_choice()
    rep: Dict[str, Any] = {
        "directory": d,
        "versions": {"fastckpt": __version__, "torch": torch.__version__, "python": platform.python_version(),
                     "kernel": platform.release()},
        "filesystem": fs,
        "space": space,
        "io_uring": _io_uring(choice),
        "engine": choice,
        "o_direct": _o_direct(d),
        "crc32": probe.crc32_impl(),
        "crc32_kernel": probe.crc32_kernel(),
        "cuda": cuda,
        "pinned_memory": pinned,
        "memory": {**_meminfo(), "staging_buffers": cfg.buffer_size * cfg.buffer_count,
                   "memlock_limit": _limit(memlock[0])},
        "knobs": knob_values,
        "environment": env,
        "memory_tier": memory_tier(),
    }
    rep["recommendations"] = _recommend(rep)
    return rep


def _recommend(r: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    fs_type = (r["filesystem"]["type"] or "").lower()
    fs_kind = r["filesystem"]["statfs_name"] or fs_type
    od = r["o_direct"]
    if od.get("writable") is False:
        out.append(f"{r['directory']} is not writable: {od.get('reason', 'permission denied')}; "
                   "checkpoints cannot be saved here")
    if fs_kind in MEMORY_FS or fs_type in MEMORY_FS:
        out.append(f"{r['directory']} is on {fs_type or fs_kind} (memory): checkpoints there use RAM and are lost "
                   "at reboot" + ("; no O_DIRECT, writes go through the page cache" if od.get("usable") is False
                                  else ""))
    elif od.get("usable") is False:
        out.append(f"no O_DIRECT here ({od.get('reason')}): fastckpt writes buffered + fdatasync, which costs "
                   "CPU and page cache")
    if fs_type in NETWORK_FS or fs_kind in NETWORK_FS or fs_type.startswith("fuse") or fs_kind == "fuse":
        out.append(f"{fs_type or fs_kind} is a network/FUSE filesystem: throughput, O_DIRECT and fsync "
                   "behaviour depend on the server")
    if fs_type == "overlay" or fs_kind == "overlayfs":
        out.append("overlayfs (a container's own filesystem): mount a volume for checkpoints")
    eng = r["engine"]
    uring = r["io_uring"]
    if eng.get("backend") is None:
        out.append(f"the engine cannot start with these knobs: {eng.get('error')} (FASTCKPT_BACKEND=uring "
                   "with io_uring refused; use auto)")
    elif eng["backend"] != "io_uring":
        if not uring["compiled"]:
            out.append("built without liburing: the thread backend is used; install liburing-dev and rebuild "
                       "(make build) for io_uring")
        elif r["knobs"].get("backend") == "threads":
            out.append("FASTCKPT_BACKEND=threads: the thread backend is used although io_uring "
                       + ("works here" if uring.get("usable") else "is refused anyway"))
        else:
            out.append(f"io_uring refused ({uring.get('refusal')}): the thread backend is used (somewhat more "
                       "CPU per GB)" + (f"; {uring['hint']}" if uring.get("hint") else ""))
    free = r["space"]["free"]
    if free < LOW_FREE:
        out.append(f"only {human(free)} free: a save needs room for the new checkpoint next to the "
                   "previous one until it replaces it")
    if r["cuda"]["available"] and r["pinned_memory"].get("usable") is False:
        out.append(f"pinned memory unavailable ({r['pinned_memory'].get('error')}): CUDA tensors are staged "
                   "through pageable memory, more slowly")
    if r.get("crc32") == "zlib" and r.get("crc32_kernel", "zlib") == "zlib":
        out.append("built without ISA-L: CRC-32s (verified loads, saves) use zlib's, about 15x slower; install "
                   "libisal-dev and rebuild (make build) for the hardware-accelerated one")
    elif r.get("crc32") == "zlib":
        out.append(f"built without ISA-L: CRC-32s of 256 bytes and more run on {r['crc32_kernel']} on this CPU, "
                   "shorter ones on zlib's; install libisal-dev and rebuild (make build) for those too")
    if not r["knobs"].get("direct", True):
        out.append("FASTCKPT_DIRECT=0: O_DIRECT is disabled by the knob")
    mt = r["memory_tier"]
    if mt["memory_fs"] is False:
        out.append(f"the memory tier's directory {mt['directory']} is on {mt['filesystem'] or mt['statfs_name']}, "
                   "not a tmpfs/ramfs: MemoryTier snapshots there go to that filesystem, not to host memory; set "
                   "FASTCKPT_MEMORY_DIR (or MemoryTier(directory=)) to a directory on a tmpfs such as /dev/shm")
    stale = [n for n in mt["namespaces"] if not n["live"]]
    if stale:
        held = sum(n["bytes"] for n in stale)
        arg = "" if "FASTCKPT_MEMORY_DIR" not in os.environ else f" {mt['directory']}"
        out.append(f"the memory tier's directory holds {len(stale)} stale namespace(s) ({human(held)}) whose "
                   f"processes are gone: `fastckpt clean-memory{arg}` frees them (--dry-run shows what first)")
    if not out:
        out.append(f"no problems found: fastckpt will use {eng['backend']} with "
                   f"{'O_DIRECT' if od.get('usable') else 'buffered I/O'} in {r['directory']}")
    return out


def doctor_text(r: Dict[str, Any]) -> str:
    fs, od, u, eng = r["filesystem"], r["o_direct"], r["io_uring"], r["engine"]
    L = []
    L.append(f"directory        {r['directory']}")
    mount = fs.get("mount") or {}
    L.append(f"filesystem       {fs['type'] or '?'} (statfs magic {fs['statfs_magic'] or '?'}"
             + (f", {fs['statfs_name']}" if fs["statfs_name"] else "") + ")"
             + (f", mounted at {mount['mount_point']} from {mount['device']}" if mount else ""))
    L.append(f"free space       {human(r['space']['free'])} of {human(r['space']['total'])}")
    if od.get("writable") is False:
        L.append(f"writable         no ({od.get('reason')})")
    a = od.get("alignment") or {}
    L.append(f"O_DIRECT         " + ("yes" if od.get("usable") else "no" if od.get("usable") is False else "unknown")
             + (f" ({od['reason']})" if od.get("reason") else "")
             + (f"; alignment: memory {a['mem']}, offset {a['offset']} (from {a['source']})" if a else ""))
    L.append(f"liburing         {'compiled in' if u['compiled'] else 'not compiled in'}")
    L.append(f"io_uring         {'usable' if u.get('usable') else 'refused: ' + str(u.get('refusal'))}"
             + (f" (kernel.io_uring_disabled = {u['kernel_io_uring_disabled']})"
                if u.get("kernel_io_uring_disabled") is not None else ""))
    L.append(f"engine backend   {eng.get('backend') or 'none: ' + str(eng.get('error'))}"
             + (f" (io_uring refused: {eng['refusal']})" if eng.get("refusal") else ""))
    L.append(f"CRC-32           {r['crc32']}"
             + (" (hardware-accelerated)" if r["crc32"] == "isa-l" else " (ISA-L not compiled in)")
             + (f"; {r['crc32_kernel']} on this CPU" if r.get("crc32_kernel", r["crc32"]) != r["crc32"] else ""))
    c = r["cuda"]
    L.append(f"CUDA             " + (f"{len(c['devices'])} device(s): {', '.join(c['devices'])}" if c["available"]
                                     else "not available" + (f" ({c['error']})" if c.get("error") else "")))
    p = r["pinned_memory"]
    L.append(f"pinned memory    " + ("usable" if p["usable"] else f"unusable: {p.get('error')}" if p["usable"] is False
                                     else f"n/a ({p.get('reason')})"))
    m = r["memory"]
    L.append(f"memory           {human(m['available'])} available of {human(m['total'])}; staging buffers "
             f"{human(m['staging_buffers'])}; RLIMIT_MEMLOCK "
             + ("unlimited" if m["memlock_limit"] is None else human(m["memlock_limit"])))
    L.extend(memory_tier_lines(r["memory_tier"]))
    L.append("knobs            " + ", ".join(f"{k}={v}" for k, v in r["knobs"].items()))
    if r["environment"]:
        L.append("environment      " + ", ".join(f"{k}={v}" for k, v in sorted(r["environment"].items())))
    v = r["versions"]
    L.append(f"versions         fastckpt {v['fastckpt']}, torch {v['torch']}, Python {v['python']}, "
             f"Linux {v['kernel']}")
    L.append("")
    for rec in r["recommendations"]:
        L.append(f"recommendation: {rec}")
    return "\n".join(L)


def age_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def namespace_line(n: Dict[str, Any]) -> str:
    """One namespace of the memory tier: state, size, newest step, checkpoint directory, owners, age."""
    pids = ", ".join(f"{o['pid']}" + ("" if o["alive"] else " gone" if o["alive"] is False else f" on {o['host']}")
                     for o in n["owners"]) or "none"
    step = "no complete snapshot" if n["newest_step"] is None else f"newest step {n['newest_step']}"
    return (f"{'live ' if n['live'] else 'stale'}  {n['path']}  {human(n['bytes'])}, {step}, checkpoint directory "
            f"{', '.join(n['directories']) or '?'}; owner pid {pids}; {age_text(n['age'])} old"
            + (f"; {len(n['other_files'])} other file(s), never removed" if n["other_files"] else ""))


def memory_tier_lines(mt: Dict[str, Any]) -> List[str]:
    kind = mt["filesystem"] or mt["statfs_name"] or "?"
    fs = kind + ("" if mt["memory_fs"] else ", not a tmpfs/ramfs" if mt["memory_fs"] is False else "")
    space = f", {human(mt['free'])} free of {human(mt['total'])}" if mt["free"] is not None else ""
    ns = mt["namespaces"]
    if not mt["exists"]:
        held = "not made yet"
    else:
        live = sum(1 for n in ns if n["live"])
        held = f"{len(ns)} namespace(s): {live} live, {len(ns) - live} stale"
        if mt["foreign"]:
            held += f"; {len(mt['foreign'])} other entr{'y' if len(mt['foreign']) == 1 else 'ies'} (not touched)"
    L = [f"memory tier      {mt['directory']} ({fs}{space}); {held}"
         + (f" (error: {mt['error']})" if mt.get("error") else "")]
    L.extend(f"  {namespace_line(n)}" for n in ns)
    return L
