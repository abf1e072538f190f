"""Background replication of committed local checkpoints to a remote tier,
and restore from it.

A :class:`Replicator` is what :class:`fastckpt.CheckpointManager` uses for
``replicate_to=URL``; it can be used on its own::

    rep = Replicator("s3://bucket/run3", storage_options={...}, keep_last_remote=3)
    rep.submit(100, "/nvme/ckpt/step_100.pt")   # returns at once
    ...
    rep.wait()                                  # raises the last upload's failure, if any
    step, path = rep.restore("/nvme/ckpt")      # newest complete remote step, verified

Uploads run on one background thread, one step at a time; a step submitted
while another is queued replaces the queued one (its future is cancelled):
the remote tier follows the newest local step and never falls behind by more
than one. A step's files are opened when it is submitted, so local retention
may delete them meanwhile. Its manifest is written after all its files are
uploaded; then ``keep_last_remote`` applies: older complete steps beyond the
newest ``keep_last_remote`` are deleted (never the step just completed, so a
step is deleted only after a newer one is complete), as are incomplete steps
older than it. A failure is logged, kept by the step's future and raised by
:meth:`wait`; it never touches the local checkpoint.

With a ``team`` (rank 0's :class:`fastckpt.remote.team.Coordinator`), each
step is a job of every rank of the job, each uploading its part, and the
manifest is written once every rank reported success; the step's files are
then opened by each rank when its part begins (:meth:`Replicator.pending_names`
names the steps that must stay on disk meanwhile).
"""

import concurrent.futures
import errno
import logging
import os
import shutil
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

from .._core.dircommit import commit_directory, new_directory
from ..errors import FormatError
from . import manifest as mf
from ._policy import TransferOptions
from .store import Store, open_store
from .._core.tempnames import is_temp
from .transfer import TransferStats, download, upload

__all__ = ["Replicator", "LocalCheckpoint", "upload_step_files", "commit_step", "restore_step", "clean_stale"]

log = logging.getLogger("fastckpt.remote")

def _local_files(path: str) -> Tuple[str, str, List[str]]:
    """(kind, name, relative paths) of a committed checkpoint: a file or a directory."""
    path = os.path.abspath(path)
    name = os.path.basename(path.rstrip(os.sep))
    if os.path.isdir(path):
        rels = []
        for d, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                if not is_temp(f):  # the engine's temporary files are never part of a checkpoint
                    rels.append(os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/"))
        if not rels:
            raise FileNotFoundError(2, f"checkpoint directory {path!r} holds no files", path)
        return "directory", name, rels
    if not os.path.isfile(path):
        raise FileNotFoundError(2, f"checkpoint {path!r} does not exist (or is not a regular file)", path)
    return "file", name, [name]


class LocalCheckpoint:
    """A committed local checkpoint's files, opened at once (so that local
    retention deleting them meanwhile cannot cut an upload short); ``close()``
    when done. ``files`` (relative paths) restricts a directory to some of
    its files: a rank's own shards in sharded (DCP) mode, where each rank
    uploads its files with :func:`upload_step_files` and rank 0 writes the
    manifest with every rank's entries (:func:`commit_step`). ``ino``: the
    inode the checkpoint (file or directory) must have, as another rank saw
    it; one saved again since (another inode) raises OSError(ESTALE), so that
    two saves' files are never mixed. A directory's files are opened relative
    to the directory opened once (``ino`` is that directory's)."""

    def __init__(self, path: Union[str, os.PathLike], files: Optional[List[str]] = None, ino: Optional[int] = None):
        self.path = os.path.abspath(os.fspath(path))
        self.kind, self.name, self.rels = _local_files(self.path)
        if files is not None:
            unknown = sorted(set(files) - set(self.rels))
            if unknown:
                raise FileNotFoundError(2, f"{self.path}: no file(s) {unknown} in the checkpoint", self.path)
            self.rels = sorted(files)
        self.fds: Dict[str, Tuple[int, int]] = {}
        base = None
        try:
            base = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if self.kind == "directory" else 0))
            self.ino = os.fstat(base).st_ino
            if ino is not None and self.ino != ino:
                raise OSError(errno.ESTALE, f"{self.path} was replaced (saved again) since its upload was planned: "
                              "not uploading a mix of two saves", self.path)
            if self.kind == "file":
                self.fds[self.name], base = (base, os.fstat(base).st_size), None
            else:
                for rel in self.rels:
                    try:
                        fd = os.open(rel, os.O_RDONLY | os.O_CLOEXEC, dir_fd=base)
                    except OSError as e:  # named after the checkpoint's file, not the relative path
                        raise OSError(e.errno, e.strerror, os.path.join(self.path, rel)) from None
                    self.fds[rel] = (fd, os.fstat(fd).st_size)
        except BaseException:
            self.close()
            raise
        finally:
            if base is not None:
                os.close(base)

    def local(self, rel: str) -> str:
        return self.path if self.kind == "file" else os.path.join(self.path, rel)

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


def upload_step_files(store: Store, step: int, opened: "LocalCheckpoint", opts: Optional[TransferOptions] = None,
                      stats: Optional[TransferStats] = None) -> List[Dict[str, Any]]:
    """Upload the files of one (sharded: this rank's) part of ``step``;
    return their manifest entries ({"path", "size", "crc32"})."""
    entries = []
    for rel, (fd, size) in opened.fds.items():
        crc = upload(store, f"{mf.step_prefix(step)}/{rel}", fd, size, opts, opened.local(rel), stats)
        entries.append({"path": rel, "size": size, "crc32": crc})
    return entries


def commit_step(store: Store, step: int, kind: str, name: str, entries: List[Dict[str, Any]],
                opts: Optional[TransferOptions] = None) -> Dict[str, Any]:
    """Write ``step``'s manifest (every rank's entries): the step is complete."""
    m = mf.make_manifest(step, kind, name, entries)
    mf.write_manifest(store, m, opts)
    return m


def clean_stale(store: Store, opts: Optional[TransferOptions] = None, below: Optional[int] = None) -> List[int]:
    """Abort unfinished uploads and delete incomplete steps (no manifest) that
    a killed process left (all of them, or those older than ``below``); return
    the steps deleted. Only while no other process replicates to the store."""
    n = store.abort_stale_uploads("")
    if n:
        log.info("fastckpt.remote: aborted %d unfinished upload(s) under %s", n, store.url)
    gone = []
    for step, files in sorted(mf.list_step_prefixes(store, opts).items()):
        if mf.MANIFEST not in files and (below is None or step < below):
            mf.delete_step(store, step, opts, files)
            gone.append(step)
    if gone:
        log.info("fastckpt.remote: deleted incomplete step(s) %s under %s", gone, store.url)
    return gone


_clean_stale = clean_stale  # Replicator's argument of that name hides the function


def restore_step(store: Store, local_dir: str, step: Optional[int] = None, opts: Optional[TransferOptions] = None
                 ) -> Tuple[int, str]:
    """Download the newest complete remote step (or ``step``) into
    ``local_dir`` and return (step, local path of the checkpoint).

    A step is used only if it has a valid manifest, every file it names
    exists with its size, and every downloaded file's CRC-32 matches; each
    file is committed locally by the engine (a directory is assembled under a
    temporary name and renamed into place). A step that fails any check is
    skipped with a warning and the next older complete step is tried.

    Raises:
        FileNotFoundError: no step (or not ``step``) is complete and intact
            (the message names the URL and why each candidate was refused).
        OSError: the store failed (after the retries).
    """
    opts = (opts or TransferOptions()).resolved()
    prefixes = mf.list_step_prefixes(store, opts)
    candidates = sorted((s for s, files in prefixes.items() if mf.MANIFEST in files), reverse=True)
    if step is not None:
        candidates = [s for s in candidates if s == step]
    refused = []
    for s in candidates:
        try:
            path = _restore_one(store, local_dir, s, prefixes[s], opts)
        except (FormatError, FileNotFoundError) as e:
            refused.append(f"step {s}: {e}")
            msg = f"fastckpt.remote: not restoring step {s} from {store.url}: {e}"
            log.warning(msg)
            warnings.warn(msg + ("; trying an older step" if s != candidates[-1] else ""), RuntimeWarning,
                          stacklevel=3)
            continue
        if refused:
            msg = f"fastckpt.remote: restored step {s} from {store.url}, older than refused step(s): " \
                  + "; ".join(refused)
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return s, path
    which = f"step {step}" if step is not None else "any step"
    why = ("; ".join(refused) if refused else
           f"no step has a manifest (steps without one: {sorted(prefixes)})" if prefixes else "it holds no step")
    raise FileNotFoundError(2, f"cannot restore {which} from {store.url}: {why}", store.url)


def _restore_one(store: Store, local_dir: str, step: int, listed: Dict[str, int], opts: TransferOptions) -> str:
    m = mf.read_manifest(store, step, opts)
    url = store.key_url(mf.step_prefix(step))
    for f in m["files"]:
        if f["path"] not in listed:
            raise FileNotFoundError(2, f"{url}/{f['path']} named by the manifest does not exist", url)
        if listed[f["path"]] != f["size"]:
            raise FormatError(f"{url}/{f['path']}: {listed[f['path']]} bytes, the manifest says {f['size']}")
    os.makedirs(local_dir, exist_ok=True)
    final = os.path.join(local_dir, m["name"])
    if m["kind"] == "file":
        f = m["files"][0]
        download(store, f"{mf.step_prefix(step)}/{f['path']}", final, f["size"], f["crc32"], opts)
        return final
    tmp = new_directory(final)  # a temporary name of this process, which the manager's cleanup knows
    try:
        for f in m["files"]:
            download(store, f"{mf.step_prefix(step)}/{f['path']}", os.path.join(tmp, *f["path"].split("/")),
                     f["size"], f["crc32"], opts)
        commit_directory(tmp, final)  # an existing step directory is exchanged with it atomically
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class _Request:
    def __init__(self, step: int, path: str, opened: Optional[LocalCheckpoint], index: int):
        self.step, self.path, self.opened, self.index = step, path, opened, index
        self.future: "concurrent.futures.Future[Dict[str, Any]]" = concurrent.futures.Future()

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()


class Replicator:
    """Replicates committed local checkpoints to ``url`` in the background
    and restores them (see the module's doc).

    Args:
        url: an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///mnt/shared/ckpt``).
        storage_options: the fsspec filesystem's options (credentials, endpoint, ...).
        keep_last_remote: complete remote steps to keep (None: all).
        transfer: part size, parallelism, retries, bandwidth cap (the knobs' when None).
        clean_stale: at construction, abort unfinished uploads and delete
            incomplete steps a killed process left (this replicator is then
            the store prefix's only writer).
        team: rank 0's :class:`fastckpt.remote.team.Coordinator` when every
            rank of a job uploads its part of each step (sharded and
            collective checkpoints of a CheckpointManager); the step's files
            are then opened by each rank when its upload begins, not by
            :meth:`submit`, and must stay until it ends (:meth:`pending_names`).

    Raises (at construction):
        MissingDependencyError, PermissionError, FileNotFoundError, OSError: see :func:`open_store`.
    """

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None, *,
                 keep_last_remote: Optional[int] = None, transfer: Optional[TransferOptions] = None,
                 clean_stale: bool = True, team: Any = None):
        if keep_last_remote is not None and keep_last_remote < 1:
            raise ValueError(f"keep_last_remote must be None or >= 1, got {keep_last_remote}")
        self.opts = (transfer or TransferOptions()).resolved()
        self.store = open_store(url, storage_options, self.opts)
        self.url = self.store.url
        self.keep_last_remote = keep_last_remote
        self.stats = TransferStats()
        self._cv = threading.Condition()
        self._queued: Optional[_Request] = None
        self._running: Optional[_Request] = None
        self._last_done: Optional[int] = None
        self._error: Optional[BaseException] = None  # the last failure, until a later step completes
        self._error_step: Optional[int] = None
        self._unraised: Optional[BaseException] = None  # what wait() raises next
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.team = team
        self._index = 0  # requests submitted so far
        self._submit_lock = threading.Lock()
        if clean_stale:
            _clean_stale(self.store, self.opts)

    # --- uploads
    def submit(self, step: int, path: Union[str, os.PathLike]) -> "concurrent.futures.Future[Dict[str, Any]]":
        """Queue the committed local checkpoint ``path`` (a file or a DCP
        directory) as ``step``; return at once with a future of its manifest.
        Its files are opened now (with a ``team``: by every rank when its
        upload begins). A step still queued is superseded (its future
        cancelled). Raises FileNotFoundError if ``path`` has no files."""
        path = os.fspath(path)
        with self._submit_lock:
            opened = LocalCheckpoint(path) if self.team is None else None
            with self._cv:
                if self._closed:
                    if opened is not None:
                        opened.close()
                    raise RuntimeError(f"Replicator for {self.url} is closed")
                self._index += 1
                index = self._index
            if self.team is not None:
                self.team.submitted(index)  # before it can become a job (the other ranks' wait())
            req = _Request(int(step), path, opened, index)
            self._enqueue(req)
        return req.future

    def _enqueue(self, req: _Request) -> None:
        with self._cv:
            old, self._queued = self._queued, req
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fastckpt-replicator", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        if old is not None:
            old.close()
            old.future.cancel()
            log.info("fastckpt.remote: step %d superseded by step %d before its upload to %s began",
                     old.step, req.step, self.url)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._queued is None and not self._closed:
                    self._cv.wait()
                if self._queued is None:
                    return
                req, self._queued = self._queued, None
                self._running = req
            m, err = None, None
            if req.future.set_running_or_notify_cancel():  # not cancelled by its caller meanwhile
                try:
                    m = self._replicate(req)
                except BaseException as e:
                    err = e
                    log.error("fastckpt.remote: replicating step %d (%s) to %s failed: %s", req.step,
                              req.path, self.url, e)
            elif self.team is not None:
                self._tell_team(lambda: self.team.skip(req.index, req.step))
            if self.team is not None:
                self._tell_team(self.team.idle)
            req.close()  # before wait() can return
            with self._cv:
                if err is not None:
                    self._error, self._error_step, self._unraised = err, req.step, err
                elif m is not None:
                    self._last_done = req.step
                    self._error = self._error_step = None
                self._running = None
                self._cv.notify_all()
            if err is not None:
                req.future.set_exception(err)
            elif m is not None:
                req.future.set_result(m)

    def _tell_team(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other ranks find rank 0 silent and give up
            log.warning("fastckpt.remote: could not tell the other ranks: %s", e)

    def _replicate(self, req: _Request) -> Dict[str, Any]:
        if self.team is not None:
            m = self.team.replicate(self.store, req.step, req.path, req.index, self.stats)
        else:
            entries = upload_step_files(self.store, req.step, req.opened, self.opts, self.stats)
            m = commit_step(self.store, req.step, req.opened.kind, req.opened.name, entries, self.opts)
        log.info("fastckpt.remote: step %d is complete at %s", req.step, self.store.key_url(mf.step_prefix(req.step)))
        try:
            self._retain(req.step)
        except Exception as e:  # the step is safe; retention tries again after the next one
            log.warning("fastckpt.remote: retention under %s failed: %s", self.url, e)
        return m

    def _retain(self, done: int) -> None:
        prefixes = mf.list_step_prefixes(self.store, self.opts)
        complete = sorted(s for s, f in prefixes.items() if mf.MANIFEST in f)
        doomed = [s for s in prefixes if mf.MANIFEST not in prefixes[s] and s < done]
        if self.keep_last_remote is not None:
            keep = set(complete[-self.keep_last_remote:]) | {done}
            doomed += [s for s in complete if s not in keep and s < done]
        for s in sorted(doomed):
            mf.delete_step(self.store, s, self.opts, prefixes[s])
            log.info("fastckpt.remote: deleted step %d from %s", s, self.url)

    def status(self) -> Dict[str, Any]:
        """{"url", "uploading" (step or None), "queued" (step or None),
        "last_complete" (the newest step this replicator completed),
        "last_error" (str or None: the last failure, until a later step
        completes), "last_error_step", "bytes_uploaded"}."""
        with self._cv:
            return {"url": self.url, "uploading": self._running.step if self._running else None,
                    "queued": self._queued.step if self._queued else None, "last_complete": self._last_done,
                    "last_error": None if self._error is None else str(self._error),
                    "last_error_step": self._error_step, "bytes_uploaded": self.stats.bytes}

    def pending_names(self) -> List[str]:
        """The local names (file or directory) of the steps queued or being
        uploaded; with a ``team``, they must stay on disk until their upload ends."""
        with self._cv:
            return [os.path.basename(r.path.rstrip(os.sep)) for r in (self._queued, self._running) if r is not None]

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Block until no upload is queued or running; return the newest step
        completed. Raises the failure of the last upload if it failed (once),
        TimeoutError if ``timeout`` passed first."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._queued is None and self._running is None, timeout):
                raise TimeoutError(f"uploads to {self.url} still running after {timeout} s")
            err, self._unraised = self._unraised, None
            done = self._last_done
        if err is not None:
            raise err
        return done

    def close(self, wait: bool = True) -> None:
        """Stop the thread after the running upload (with ``wait``, after the
        queued one too; without, the queued one is cancelled)."""
        with self._cv:
            self._closed = True
            dropped = None
            if not wait and self._queued is not None:
                dropped, self._queued = self._queued, None
            self._cv.notify_all()
            t = self._thread
        if dropped is not None:
            dropped.close()
            dropped.future.cancel()
        if t is not None:
            t.join()
        if self.team is not None:
            self.team.close()  # the other ranks stop waiting for jobs

    def __enter__(self) -> "Replicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the remote tier
    def list_steps(self) -> List[int]:
        """Complete remote steps (with a manifest), oldest first."""
        return mf.list_steps(self.store, self.opts)

    def delete_step(self, step: int) -> None:
        mf.delete_step(self.store, step, self.opts)

    def restore(self, local_dir: Union[str, os.PathLike], step: Optional[int] = None) -> Tuple[int, str]:
        """See :func:`restore_step`."""
        return restore_step(self.store, os.fspath(local_dir), step, self.opts)

