"""crashfs: an in-memory FUSE filesystem that records every change, and the persistence model
that turns its record into the states a power cut could leave.

    python crashfs.py MOUNTPOINT LOGFILE     # serves until unmounted, then writes LOGFILE

The daemon (mfusepy over libfuse3, single-threaded, so the record has one order) applies every
change to a :class:`Model` and appends it to an op log: ``create``, ``mkdir``, ``symlink``,
``write``, ``truncate``, ``rename`` (with RENAME_NOREPLACE or RENAME_EXCHANGE), ``unlink``, ``rmdir``, ``fsync`` (of a file: fsync and
fdatasync alike make its data and size durable), ``fsyncdir`` (makes a directory's entries
durable) and ``mark`` (``stat`` of a name starting with ``.crashfs-mark=`` records the rest of
the name and answers ENOENT: the tests' way to say "a save began/returned here").

Persistence model (strict, as POSIX allows and ext4/XFS can show): a file's contents are durable
as of its last fsync/fdatasync (never synced: empty); a directory's entries are durable as of
its last fsync (so a new name, an unlink or a rename, in either directory, survives only once
that directory is fsynced). :func:`crash_states` replays a log and, before the first op and
after each one, yields the states a power cut there may leave, in the spirit of CrashMonkey and
LazyFS: namespace durable-only or fully persisted (a journal commit just before the cut),
crossed with data durable-only or fully persisted.  Four states per cut point; a state is a
hashable tree, so that a checker sees each distinct one once.

Clients (``per_client=True``, for several processes writing one file, as the ranks of a
collective save do on a shared filesystem whose every node caches its own writes: NFS, Lustre):
the daemon tags each ``write``, ``truncate`` and ``fsync`` with the calling process's pid (a
trailing element that the default model ignores); a file's durable contents then take only the
changes of the process that fsyncs, in order, on top of what was durable: a process's writes
are durable only once that process itself fsyncs the file (on one local filesystem any fsync of
the file would do: the default model).
"""

import errno
import os
import pickle
import stat
import subprocess
import sys
import threading
import time
from typing import Dict, Iterator, List, Tuple

MARK = ".crashfs-mark="
ROOT = 1


class File:
    __slots__ = ("data", "ver")

    def __init__(self):
        self.data = bytearray()
        self.ver = 0  # bumped by every change: (ino, ver) names one content


class Dir:
    __slots__ = ("entries",)

    def __init__(self):
        self.entries: Dict[str, int] = {}


class Link:
    __slots__ = ("target",)

    def __init__(self, target: str):
        self.target = target


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class Model:
    """The live filesystem plus what of it is durable. Nodes are never freed: an unlinked file
    may still be named by a durable directory entry."""

    def __init__(self, per_client: bool = False):
        self.per_client = per_client
        self.pending: Dict[int, Dict[object, List[tuple]]] = {}  # per_client: ino -> pid -> its unsynced ops
        self.nodes: Dict[int, object] = {ROOT: Dir()}
        self.next_ino = ROOT + 1
        self.durable_data: Dict[int, Tuple[int, bytes]] = {}  # ino -> (ver, bytes) at last fsync
        self.durable_entries: Dict[int, Dict[str, int]] = {ROOT: {}}  # dir ino -> entries at last fsync
        self.marks: List[str] = []

    # ---- lookups
    def resolve(self, path: str) -> int:
        ino = ROOT
        for part in [p for p in path.split("/") if p]:
            node = self.nodes[ino]
            if not isinstance(node, Dir):
                raise _err(errno.ENOTDIR)
            if part not in node.entries:
                raise _err(errno.ENOENT)
            ino = node.entries[part]
        return ino

    def parent(self, path: str) -> Tuple[int, str]:
        head, name = os.path.split(path.rstrip("/"))
        ino = self.resolve(head or "/")
        if not isinstance(self.nodes[ino], Dir):
            raise _err(errno.ENOTDIR)
        return ino, name

    def new_ino(self) -> int:
        ino = self.next_ino
        self.next_ino += 1
        return ino

    # ---- the one place where state changes; raises OSError before changing anything
    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind in ("create", "mkdir", "symlink"):
            p, name, ino = op[1], op[2], op[3]
            if name in self.nodes[p].entries:
                raise _err(errno.EEXIST)
            self.nodes[ino] = File() if kind == "create" else Dir() if kind == "mkdir" else Link(op[4])
            self.next_ino = max(self.next_ino, ino + 1)
            self.nodes[p].entries[name] = ino
        elif kind == "write":
            f = self.nodes[op[1]]
            off, data = op[2], op[3]
            if len(f.data) < off:
                f.data.extend(bytes(off - len(f.data)))
            f.data[off:off + len(data)] = data
            f.ver += 1
            self._pend(op)
        elif kind == "truncate":
            f = self.nodes[op[1]]
            size = op[2]
            del f.data[size:]
            f.data.extend(bytes(size - len(f.data)))
            f.ver += 1
            self._pend(op)
        elif kind == "rename":
            p1, n1, p2, n2, flags = op[1:6]
            src, dst = self.nodes[p1].entries, self.nodes[p2].entries
            if n1 not in src:
                raise _err(errno.ENOENT)
            moving = self.nodes[src[n1]]
            if flags & 2:  # RENAME_EXCHANGE: both names exist, and swap what they name in one step
                if n2 not in dst:
                    raise _err(errno.ENOENT)
                src[n1], dst[n2] = dst[n2], src[n1]
                return
            if n2 in dst and dst[n2] != src[n1]:
                if flags & 1:  # RENAME_NOREPLACE
                    raise _err(errno.EEXIST)
                old = self.nodes[dst[n2]]
                if isinstance(old, Dir) != isinstance(moving, Dir):
                    raise _err(errno.EISDIR if isinstance(old, Dir) else errno.ENOTDIR)
                if isinstance(old, Dir) and old.entries:
                    raise _err(errno.ENOTEMPTY)
            dst[n2] = src.pop(n1)
        elif kind in ("unlink", "rmdir"):
            p, name = op[1], op[2]
            entries = self.nodes[p].entries
            if name not in entries:
                raise _err(errno.ENOENT)
            node = self.nodes[entries[name]]
            if kind == "unlink" and isinstance(node, Dir):
                raise _err(errno.EISDIR)
            if kind == "rmdir" and not isinstance(node, Dir):
                raise _err(errno.ENOTDIR)
            if kind == "rmdir" and node.entries:
                raise _err(errno.ENOTEMPTY)
            del entries[name]
        elif kind == "fsync":
            f = self.nodes[op[1]]
            if isinstance(f, File) and self.per_client:
                self._sync_client(op[1], op[2] if len(op) > 2 else None)
            elif isinstance(f, File):
                self.durable_data[op[1]] = (f.ver, bytes(f.data))
        elif kind == "fsyncdir":
            self.durable_entries[op[1]] = dict(self.nodes[op[1]].entries)
        elif kind == "mark":
            self.marks.append(op[1])
        else:
            raise ValueError(f"unknown op {op!r}")

    def _pend(self, op: tuple) -> None:
        if self.per_client:
            pid = op[4] if op[0] == "write" and len(op) > 4 else op[3] if op[0] == "truncate" and len(op) > 3 else None
            self.pending.setdefault(op[1], {}).setdefault(pid, []).append(op)

    def _sync_client(self, ino: int, pid) -> None:
        """per_client fsync by ``pid``: its own unsynced changes, in order, on top of what was durable."""
        f = self.nodes[ino]
        data = bytearray(self.durable_data[ino][1]) if ino in self.durable_data else bytearray()
        for op in self.pending.get(ino, {}).pop(pid, []):
            if op[0] == "write":
                off, chunk = op[2], op[3]
                if len(data) < off:
                    data.extend(bytes(off - len(data)))
                data[off:off + len(chunk)] = chunk
            else:
                del data[op[2]:]
                data.extend(bytes(op[2] - len(data)))
        if data == f.data:
            self.durable_data[ino] = (f.ver, bytes(data))
        else:  # a content no live version had: a key of its own (the live one moves on too)
            self.durable_data[ino] = (f.ver + 1, bytes(data))
            f.ver += 2

    # ---- crash states
    def namespace(self) -> Dict[int, Dict[str, int]]:
        """A copy of every directory's live entries."""
        return {ino: dict(n.entries) for ino, n in self.nodes.items() if isinstance(n, Dir)}

    def tree(self, names, durable_data: bool) -> tuple:
        """The state after a power cut now: sorted (path, kind, content) rows. ``names``: "durable"
        (as of each directory's last fsync), "live", or a :meth:`namespace` taken earlier. File
        content is (ino, version) as a stand-in for its bytes (see :meth:`content`)."""
        rows = []

        def walk(ino: int, prefix: str, seen: frozenset) -> None:
            if names == "durable":
                entries = self.durable_entries.get(ino, {})
            elif names == "live":
                entries = self.nodes[ino].entries
            else:
                entries = names.get(ino, {})
            for name in sorted(entries):
                child, path = entries[name], prefix + name
                node = self.nodes[child]
                if isinstance(node, Dir):
                    rows.append((path, "d", None))
                    if child not in seen:  # a durable rename can make a loop of stale entries
                        walk(child, path + "/", seen | {child})
                elif isinstance(node, Link):
                    rows.append((path, "l", node.target))
                elif durable_data:
                    rows.append((path, "f", (child, self.durable_data[child][0]) if child in self.durable_data
                                 else (child, -1)))
                else:
                    rows.append((path, "f", (child, node.ver)))

        walk(ROOT, "", frozenset([ROOT]))
        return tuple(rows)

    def content(self, key: Tuple[int, int]) -> bytes:
        ino, ver = key
        if ver == -1:
            return b""
        if ino in self.durable_data and self.durable_data[ino][0] == ver:
            return self.durable_data[ino][1]
        f = self.nodes[ino]
        assert f.ver == ver, "content asked for after the model moved on"
        return bytes(f.data)


VARIANTS = (  # (names, durable_data, label)
    ("durable", True, "synced only"),
    ("live", True, "names persisted, unsynced data lost"),
    ("durable", False, "unsynced data persisted, names not"),
    ("live", False, "everything persisted (as SIGKILL)"),
)
PREFIX = "names persisted up to an earlier op, unsynced data lost"
NAMESPACE_OPS = ("create", "mkdir", "symlink", "rename", "unlink", "rmdir")


def crash_states(log: List[tuple], per_client: bool = False) -> Iterator[Tuple[int, str, tuple, Model]]:
    """Replays ``log``; yields (cut, variant, tree, model) for a power cut before op ``cut``
    (0 = before the first op, len(log) = after the last). Read a tree's file contents through
    ``model.content`` before asking for the next state.

    Besides the four VARIANTS, a journaling filesystem may have committed the namespace
    changes in order up to any op since the last directory fsync (which commits them all): one
    more state per namespace change in that window, with unsynced data lost. ``per_client``:
    see the module's docstring (Clients)."""
    m = Model(per_client)
    window = [m.namespace()]  # the namespace after each change since the last directory fsync
    for cut in range(len(log) + 1):
        if cut:
            op = log[cut - 1]
            m.apply(op)
            if op[0] == "fsyncdir":
                window = [m.namespace()]
            elif op[0] in NAMESPACE_OPS:
                window.append(m.namespace())
        for names, durable_data, label in VARIANTS:
            yield cut, label, m.tree(names, durable_data), m
        for names in window[:-1]:  # the last one is the live namespace, seen above
            yield cut, PREFIX, m.tree(names, True), m


def materialize(tree: tuple, model: Model, root: str) -> None:
    """Writes a crash state under the (empty) directory ``root``."""
    for path, kind, content in tree:
        full = os.path.join(root, path)
        if kind == "d":
            os.makedirs(full, exist_ok=True)
        elif kind == "l":
            os.symlink(content, full)
        else:
            with open(full, "wb") as f:
                f.write(model.content(content))


# ---------------------------------------------------------------- the FUSE daemon
def serve(mountpoint: str, logfile: str) -> None:
    import mfusepy as fuse

    class CrashFS(fuse.Operations):
        use_ns = True

        def __init__(self):
            self.m = Model()
            self.log: List[tuple] = []
            self.fhs: Dict[int, int] = {}  # open handle -> ino (a renamed or unlinked file stays open)
            self.next_fh = 1

        def do(self, op: tuple) -> None:
            try:
                self.m.apply(op)
            except OSError as e:
                raise fuse.FuseOSError(e.errno)
            self.log.append(op)

        def client(self) -> int:
            """The calling process (FUSE gives the calling thread: an io_uring worker or one of the
            engine's threads writes for its process), for per_client checks."""
            tid = fuse.fuse_get_context()[2]
            try:
                with open(f"/proc/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Tgid:"):
                            return int(line.split()[1])
            except OSError:
                pass
            return tid

        def ino(self, path: str) -> int:
            try:
                return self.m.resolve(path)
            except OSError as e:
                raise fuse.FuseOSError(e.errno)

        def parent(self, path: str) -> Tuple[int, str]:
            try:
                return self.m.parent(path)
            except OSError as e:
                raise fuse.FuseOSError(e.errno)

        def handle(self, ino: int) -> int:
            fh, self.next_fh = self.next_fh, self.next_fh + 1
            self.fhs[fh] = ino
            return fh

        def node_ino(self, path, fh) -> int:
            return self.fhs[fh] if fh else self.ino(path)

        # -- attributes and lookups
        def getattr(self, path, fh=None):
            if os.path.basename(path).startswith(MARK):
                self.do(("mark", os.path.basename(path)[len(MARK):]))
                raise fuse.FuseOSError(errno.ENOENT)
            ino = self.fhs[fh] if fh in self.fhs else self.ino(path)
            node = self.m.nodes[ino]
            now = time.time_ns()
            st = dict(st_ino=ino, st_uid=os.getuid(), st_gid=os.getgid(), st_atime=now, st_mtime=now,
                      st_ctime=now, st_nlink=1, st_blksize=4096)
            if isinstance(node, Dir):
                st.update(st_mode=stat.S_IFDIR | 0o755, st_nlink=2, st_size=4096)
            elif isinstance(node, Link):
                st.update(st_mode=stat.S_IFLNK | 0o777, st_size=len(node.target))
            else:
                st.update(st_mode=stat.S_IFREG | 0o644, st_size=len(node.data),
                          st_blocks=(len(node.data) + 511) // 512)
            return st

        def access(self, path, amode):
            self.ino(path)
            return 0

        def statfs(self, path):
            return dict(f_bsize=4096, f_frsize=4096, f_blocks=1 << 24, f_bfree=1 << 23, f_bavail=1 << 23,
                        f_files=1 << 20, f_ffree=1 << 19, f_favail=1 << 19, f_namemax=255)

        def chmod(self, path, mode):
            return 0

        def chown(self, path, uid, gid):
            return 0

        def utimens(self, path, times=None):
            return 0

        def readlink(self, path):
            node = self.m.nodes[self.ino(path)]
            if not isinstance(node, Link):
                raise fuse.FuseOSError(errno.EINVAL)
            return node.target

        # -- directories
        def opendir(self, path):
            return self.handle(self.ino(path))

        def releasedir(self, path, fh):
            self.fhs.pop(fh, None)
            return 0

        def readdir(self, path, fh):
            node = self.m.nodes[self.fhs.get(fh) or self.ino(path)]
            return [".", ".."] + list(node.entries)

        def fsyncdir(self, path, datasync, fh):
            self.do(("fsyncdir", self.node_ino(path, fh)))
            return 0

        def mkdir(self, path, mode):
            p, name = self.parent(path)
            self.do(("mkdir", p, name, self.m.next_ino))
            return 0

        def rmdir(self, path):
            self.do(("rmdir",) + self.parent(path))
            return 0

        def symlink(self, target, source):  # mfusepy: creates `target` pointing to `source`
            p, name = self.parent(target)
            self.do(("symlink", p, name, self.m.next_ino, source))
            return 0

        def unlink(self, path):
            self.do(("unlink",) + self.parent(path))
            return 0

        def rename(self, old, new, flags=0):
            if flags & ~3 or flags == 3:  # RENAME_NOREPLACE and RENAME_EXCHANGE are modelled
                raise fuse.FuseOSError(errno.EINVAL)
            self.do(("rename",) + self.parent(old) + self.parent(new) + (flags,))
            return 0

        # -- files
        def create(self, path, mode, fi=None):
            p, name = self.parent(path)
            ino = self.m.next_ino
            self.do(("create", p, name, ino))
            return self.handle(ino)

        def open(self, path, flags):
            return self.handle(self.ino(path))

        def release(self, path, fh):
            self.fhs.pop(fh, None)
            return 0

        def flush(self, path, fh):
            return 0

        def read(self, path, size, offset, fh):
            return bytes(self.m.nodes[self.node_ino(path, fh)].data[offset:offset + size])

        def write(self, path, data, offset, fh):
            self.do(("write", self.node_ino(path, fh), offset, bytes(data), self.client()))
            return len(data)

        def truncate(self, path, length, fh=None):
            self.do(("truncate", self.node_ino(path, fh), length, self.client()))
            return 0

        def fallocate(self, path, mode, offset, size, fh):
            if mode != 0:
                raise fuse.FuseOSError(errno.EOPNOTSUPP)
            ino = self.node_ino(path, fh)
            if offset + size > len(self.m.nodes[ino].data):
                self.do(("truncate", ino, offset + size, self.client()))
            return 0

        def fsync(self, path, datasync, fh):
            self.do(("fsync", self.node_ino(path, fh), self.client()))
            return 0

    class FUSE(fuse.FUSE):  # mfusepy drops rename(2)'s flags; keep RENAME_NOREPLACE meaningful
        def rename_fuse_3(self, old, new, flags):
            return self.operations.rename(old.decode(), new.decode(), flags)

    def unmount_when_orphaned(parent: int) -> None:  # the test died without unmounting: do it
        while os.getppid() == parent:
            time.sleep(0.5)
        subprocess.run(["fusermount3", "-uz", mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    threading.Thread(target=unmount_when_orphaned, args=(os.getppid(),), daemon=True).start()
    ops = CrashFS()
    try:
        FUSE(ops, mountpoint, foreground=True, nothreads=True, fsname="crashfs", hard_remove=True,
             attr_timeout=0, entry_timeout=0, negative_timeout=0)
    finally:
        tmp = logfile + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(ops.log, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, logfile)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
