"""A step replicated by every rank of a job: each rank uploads its own part.

Sharded (DCP) checkpoints: rank r uploads the files it wrote (``__r_<n>.distcp``;
``.metadata`` and any other file are rank 0's). One-file checkpoints written by
every rank (``fastckpt.save(..., group=pg)``): the file's parts are cut into
contiguous shares (:func:`fastckpt.remote.transfer.split_parts`) and rank r
sends share r as parts of ONE multipart upload that rank 0 created and, with
every part's ETag, completes; where the store cannot share an upload between
processes (``file://``, fsspec's other filesystems: ``Store.shared_uploads``
is False) or the file is a single part, rank 0 uploads it alone, since one
writer is then the only sound way to make it appear whole.

Rank 0 writes the step's manifest, its commit marker, only after every rank
has reported success (its files' sizes and CRC-32s, or its parts' ETags and
CRC-32s) and the shared upload is complete. A rank that fails, or dies, means
no manifest: the step is never restored, and the failure is raised by
``wait()`` on rank 0 and on the rank that failed (every rank learns rank 0's
verdict). Local checkpoints and training are never touched.

Rank 0 coordinates from its :class:`~fastckpt.remote.Replicator`'s thread
(:class:`Coordinator`); every other rank serves it from a thread of its own
(:class:`Worker`). They talk through the job's key-value store (torch.distributed's
c10d ``Store``: the TCPStore of torchrun or ``env://``, a FileStore, ...), each
thread through its own client (``Store.clone()``, the store's way to be used
from several threads), never through a process group: no collective runs in
the background, so no background thread shares a group with the training loop,
ranks that reach a step's upload at different times never pair the wrong
collectives, and a rank that died is found by a deadline (``peer_timeout``:
no sign of life for that long) rather than by a group's timeout.

Keys, under a prefix of the manager's (``fastckpt-remote/<uuid>``)::

    submitted       rank 0: the index of the last step queued (1, 2, ...), set before it can become a job
    msg/<r>/<k>     rank 0 to rank r, its k-th message (k = 1, 2, ...): "job" (job n: "index", "step",
                    "name", "ino", "mode" "files" with "files": rank r's relative paths, or "parts" with
                    "key", "token", "size", "part": the shared upload), "verdict" (job n: "ok", "error";
                    ok: the manifest is written), "skip" (a step cancelled before it began), "stop"
                    (rank 0's replicator closed); "wake": rank r's own, to stop waiting when it closes
    rep/<n>/<r>     rank r's report on job n: {"entries": [...]}, {"parts": [[number, etag, crc, length]]}
                    or {"error": "..."}; then it adds 1 to nrep/<n>
    hb/<r>          rank r's sign of life while it works on a job ("<n>:<count>"), "bye" once it stopped

A rank waits for its next message with one long wait (no polling; a store's
timeouts would be logged by torch), rank 0 polls the count of reports and the
signs of life about once a second while a job runs.

Every rank opens the step under its path as it sees it (the directory is
shared) and checks that its inode is the one rank 0 planned the job with: a
step saved again meanwhile is never mixed with the old one. The step's files
stay on disk until the job ends (the manager's retention leaves a step
queued or being uploaded alone).
"""

import errno
import logging
import os
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..errors import RanksFailed
from . import manifest as mf
from ._policy import TransferOptions, retry
from .board import Board, Liveness, Ticker, heartbeat_interval
from .replicator import LocalCheckpoint, commit_step, upload_step_files
from .store import Store, Upload
from .transfer import (TransferStats, abort_upload, complete_upload, plan_parts, send_parts, split_parts,
                       _plan)

__all__ = ["Coordinator", "Worker", "RanksFailed", "owner_of"]

log = logging.getLogger("fastckpt.remote")

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def owner_of(rel: str, world: int) -> int:
    """The rank that uploads the file ``rel`` of a sharded step: r for DCP's
    ``__r_<n>.distcp`` (what rank r wrote), 0 for anything else."""
    m = _SHARD.match(rel)
    r = int(m.group(1)) if m else 0
    return r if r < world else 0


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _text(e: BaseException) -> str:
    """A failure in words for another rank: an OSError's message (naming its
    path if the message does not), else the exception's type and first line."""
    if isinstance(e, OSError) and e.strerror:
        if e.filename and str(e.filename) not in e.strerror:
            return f"{e.strerror} ({e.filename})"
        return e.strerror
    return _first_line(e)


def _share(store: Store, job: Dict[str, Any], rank: int, path: str, opts: TransferOptions,
           stats: TransferStats, up: Optional[Upload] = None) -> Dict[str, Any]:
    """This rank's part of ``job`` (its message: "files" are this rank's) for
    the step at ``path`` as this rank sees it: its report. ``up``: rank 0's own
    handle of a shared upload."""
    if job["mode"] == "files":
        if not job["files"]:
            return {"entries": []}
        opened = LocalCheckpoint(path, files=job["files"], ino=job["ino"])
        try:
            return {"entries": upload_step_files(store, job["step"], opened, opts, stats)}
        finally:
            opened.close()
    parts = _plan(job["size"], job["part"], 1)  # "parts": this rank's share of the parts of one upload
    mine = split_parts(parts, job["world"])[rank]
    if not mine:
        return {"parts": []}
    opened = LocalCheckpoint(path, ino=job["ino"])
    try:
        fd, size = opened.fds[opened.rels[0]]
        if size != job["size"]:
            raise OSError(errno.ESTALE, f"{path} has {size} bytes here, {job['size']} on rank 0", path)
        if up is None:
            up = store.join_upload(job["key"], job["token"])
        sent = send_parts(up, fd, mine, opts, path, store.key_url(job["key"]), stats, total=len(parts))
    finally:
        opened.close()
    return {"parts": [[n, e, c, length] for n, (e, c, length) in sorted(sent.items())]}


class Coordinator:
    """Rank 0's side: turns each step of its Replicator into a job for every
    rank, uploads rank 0's part, gathers the reports, completes a shared upload
    and writes the manifest (see the module's doc). Used by one Replicator."""

    def __init__(self, store: Any, prefix: str, world: int, opts: Optional[TransferOptions] = None):
        self.world = world
        self.opts = (opts or TransferOptions()).resolved()
        self.timeout = float(self.opts.peer_timeout)
        self.interval = heartbeat_interval(self.timeout)
        self.poll = min(1.0, self.interval)
        self._submit = Board(store, prefix)       # submitted(): the threads that commit steps (under a lock)
        self._submit_lock = threading.Lock()
        self._board = self._submit.clone()        # the replicator's thread
        self._ticker = Ticker(self._submit.clone(), 0, self.interval)
        self._n = 0                               # jobs so far
        self._k = 0                               # messages sent to every rank so far
        self._read = {r: 0 for r in range(1, world)}  # the messages each rank surely read (deleted)
        self._closed = False

    def _send(self, msgs: Dict[int, Dict[str, Any]]) -> int:
        """Message k+1 to every other rank (``msgs[r]``); returns k+1."""
        self._k += 1
        self._board.set_many({f"msg/{r}/{self._k}": m for r, m in msgs.items()})
        return self._k

    def _to_all(self, msg: Dict[str, Any]) -> int:
        return self._send({r: msg for r in range(1, self.world)})

    def submitted(self, index: int) -> None:
        """A step was queued as ``index`` (before it can become a job: a rank's
        ``wait()`` that reads it then waits for that job)."""
        with self._submit_lock:
            self._submit.set("submitted", index)

    def skip(self, index: int, step: int) -> None:
        """The step queued as ``index`` was cancelled before it began."""
        self._to_all({"kind": "skip", "index": index, "step": step})

    def idle(self) -> None:
        """The replicator finished a step (its retention too): rank 0 stops
        showing signs of life until the next job."""
        self._ticker.stop()

    def _plan(self, store: Store, job: Dict[str, Any], path: str) -> List[List[str]]:
        """Fills ``job`` for the step at ``path``; returns every rank's files."""
        files: List[List[str]] = [[] for _ in range(self.world)]
        before = os.stat(path).st_ino
        opened = LocalCheckpoint(path)  # lists it (and proves it can be opened)
        opened.close()
        if os.stat(path).st_ino != before or opened.ino != before:
            raise OSError(errno.ESTALE, f"{path} was replaced (saved again) while its upload was being planned", path)
        job.update(ino=before, kind=opened.kind)
        if opened.kind == "directory":
            for rel in opened.rels:
                files[owner_of(rel, self.world)].append(rel)
            return files
        size = os.stat(path).st_size
        parts = plan_parts(store, size, self.opts)
        if store.shared_uploads and len(parts) > 1:
            job.update(mode="parts", key=f"{mf.step_prefix(job['step'])}/{job['name']}", size=size,
                       part=parts[0][2])
        else:  # one writer: rank 0 alone
            files[0] = [job["name"]]
        return files

    def replicate(self, store: Store, step: int, path: str, index: int,
                  stats: Optional[TransferStats] = None) -> Dict[str, Any]:
        """Job for the step at ``path`` (queued as ``index``), run with every
        rank; its manifest. Raises the failure (OSError; RanksFailed when
        another rank failed or died): no manifest was written. Rank 0 shows
        signs of life from now until :meth:`idle`."""
        if self._closed:
            raise RuntimeError("fastckpt.remote: the coordinator is closed")
        stats = stats or TransferStats()
        self._n += 1
        n = self._n
        self._ticker.start(n)
        name = os.path.basename(path.rstrip(os.sep))
        job: Dict[str, Any] = {"kind": "job", "n": n, "index": index, "step": step, "name": name,
                               "world": self.world, "mode": "files", "ino": None}
        files: List[List[str]] = [[] for _ in range(self.world)]
        up: Optional[Upload] = None
        url = store.key_url(mf.step_prefix(step))
        failures: Dict[int, str] = {}
        own: Optional[BaseException] = None
        m: Optional[Dict[str, Any]] = None
        k = None
        silent: set = set()
        try:
            try:
                files = self._plan(store, job, path)
                if job["mode"] == "parts":
                    key_url = store.key_url(job["key"])
                    up = retry(lambda: store.begin_upload(job["key"], job["size"]), f"upload of {path} to {key_url}",
                               key_url, self.opts)
                    job["token"] = up.token
            except Exception as e:  # noqa: BLE001 - a job that asks nothing of the others, then the error
                job.update(mode="files", ino=None)
                files = [[] for _ in range(self.world)]
                own, failures[0] = e, _text(e)
            k = self._send({r: dict(job, files=files[r]) for r in range(1, self.world)})
            mine: Dict[str, Any] = {}
            if own is None:
                try:
                    mine = _share(store, dict(job, files=files[0]), 0, path, self.opts, stats, up)
                except Exception as e:  # noqa: BLE001 - reported with the others'
                    own, failures[0] = e, _text(e)
            reports, silent = self._collect(n)
            for r in range(1, self.world):
                rep = reports[r]
                if "error" in rep:
                    failures[r] = rep["error"]
                elif not self._covers(job, files, r, rep):
                    failures[r] = f"it reported another part of the step than it was given: {rep}"
            if not failures:
                reports[0] = mine
                m = self._commit(store, job, reports, path, up)
        except Exception as e:  # noqa: BLE001 - completing, the manifest, or the store itself failed
            own, failures[0] = e, _text(e)
        if m is None and up is not None:
            abort_upload(up)
        err = None if m is not None else self._failure(step, url, own, failures)
        try:
            if k is not None:
                self._to_all({"kind": "verdict", "n": n, "index": index, "step": step, "ok": m is not None,
                              "error": None if err is None else _text(err)})
                self._clean(n, k, silent)
        except Exception as e:  # noqa: BLE001 - the other ranks find rank 0 silent and give up
            log.warning("fastckpt.remote: could not tell the other ranks the outcome of step %d: %s", step,
                        _first_line(e))
        if err is not None:
            if err is own:
                raise own
            raise err from own
        return m

    def _covers(self, job: Dict[str, Any], files: List[List[str]], r: int, rep: Dict[str, Any]) -> bool:
        if job["mode"] == "files":
            return sorted(e["path"] for e in rep.get("entries", [])) == sorted(files[r])
        want = [p[0] for p in split_parts(_plan(job["size"], job["part"], 1), self.world)[r]]
        return [p[0] for p in rep.get("parts", [])] == want

    def _collect(self, n: int) -> Tuple[Dict[int, Dict[str, Any]], set]:
        """Every other rank's report on job n (the count of reports polled about
        once a second), and the ranks that stopped or died before reporting
        (an error report each)."""
        reports: Dict[int, Dict[str, Any]] = {}
        silent = set()
        pending = set(range(1, self.world))
        live = Liveness(self._board, pending, self.timeout)
        seen = 0
        while pending:
            count = self._board.add(f"nrep/{n}", 0)
            if count != seen:
                seen = count
                ranks = sorted(pending)
                for r, got in zip(ranks, self._board.get_many([f"rep/{n}/{r}" for r in ranks])):
                    if got is not None:
                        reports[r] = got
                        pending.discard(r)
            for r, why in live.gone(pending).items():
                got = self._board.get_many([f"rep/{n}/{r}"])[0]  # it may have reported just now
                if got is None:
                    got = {"error": f"{why}; no report on its part"}
                    silent.add(r)
                reports[r] = got
                pending.discard(r)
            if pending:
                time.sleep(self.poll)
        return reports, silent

    def _commit(self, store: Store, job: Dict[str, Any], reports: Dict[int, Dict[str, Any]], path: str,
                up: Optional[Upload]) -> Dict[str, Any]:
        """Every rank did its part: complete the shared upload, write the manifest."""
        step, name = job["step"], job["name"]
        if job["mode"] == "parts":
            sent = {n: (e, c, length) for r in range(self.world) for n, e, c, length in reports[r]["parts"]}
            crc = complete_upload(store, up, job["key"], sent, job["size"], self.opts,
                                  f"upload of {path} to {store.key_url(job['key'])}")
            entries = [{"path": name, "size": job["size"], "crc32": crc}]
        else:
            entries = [e for r in range(self.world) for e in reports[r]["entries"]]
        return commit_step(store, step, job["kind"], name, entries, self.opts)

    def _failure(self, step: int, url: str, own: Optional[BaseException], failures: Dict[int, str]) -> OSError:
        if own is not None and len(failures) == 1 and isinstance(own, OSError):
            return own  # only rank 0's: its own error (the URL, the file, the cause)
        why = "; ".join(f"rank {r}: {failures[r]}" for r in sorted(failures))
        code = getattr(own, "errno", None) or errno.EIO
        return RanksFailed(code, f"step {step} was not replicated to {url} (no manifest written): {why}", url,
                           dict(failures))

    def _clean(self, n: int, k: int, silent: set) -> None:
        """Job n (message k) ended: its reports go, and every message that a rank
        surely read (it reported on job n: it read message k and those before)."""
        keys = [f"rep/{n}/{r}" for r in range(1, self.world)] + [f"nrep/{n}"]
        for r in range(1, self.world):
            if r not in silent:
                keys += [f"msg/{r}/{i}" for i in range(self._read[r] + 1, k + 1)]
                self._read[r] = k
        self._board.delete(keys)

    def close(self) -> None:
        """Tell every rank that no job comes any more."""
        if self._closed:
            return
        self._closed = True
        try:
            self._to_all({"kind": "stop"})
        except Exception as e:  # noqa: BLE001
            log.warning("fastckpt.remote: could not tell the other ranks that uploads ended: %s", e)
        self._ticker.close()


class Worker:
    """A rank other than 0: serves rank 0's jobs from a thread of its own (see
    the module's doc) and keeps what it learns for :meth:`wait` and :meth:`status`."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, remote: Store, directory: str,
                 opts: Optional[TransferOptions] = None):
        self.rank, self.world = rank, world
        self.remote, self.directory = remote, os.fspath(directory)
        self.url = remote.url
        self.opts = (opts or TransferOptions()).resolved()
        self.timeout = float(self.opts.peer_timeout)
        self.interval = heartbeat_interval(self.timeout)
        self.stats = TransferStats()
        self._caller = Board(store, prefix)      # wait() and close(): the caller's threads (under the lock)
        self._caller_lock = threading.Lock()
        self._board = self._caller.clone()       # the worker's thread
        self._ticker = Ticker(self._caller.clone(), rank, self.interval)
        self._cv = threading.Condition()
        self._k = 0                              # messages read
        self._index = 0                          # the last step (by its queue index) whose verdict is known here
        self._phase = "idle"                     # "uploading" its part, "awaiting" rank 0's verdict, or "idle"
        self._job_step: Optional[int] = None
        self._last_done: Optional[int] = None
        self._error: Optional[str] = None
        self._error_step: Optional[int] = None
        self._unraised: Optional[BaseException] = None
        self._closing = False
        self._serve_to_stop = True
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"fastckpt-remote-rank{rank}", daemon=True)
        self._thread.start()

    # --- the worker's thread
    def _next(self) -> Dict[str, Any]:
        with self._cv:
            self._k += 1
            k = self._k
        return self._board.wait_for(f"msg/{self.rank}/{k}")

    def _quit(self) -> bool:
        with self._cv:
            return self._closing and not self._serve_to_stop

    def _loop(self) -> None:
        try:
            while True:
                msg = self._next()
                kind = msg.get("kind")
                if kind == "stop" or self._quit():
                    return
                if kind == "wake":  # close() gave up on rank 0 while this thread was idle
                    if self._closing:
                        return
                    continue
                if kind == "skip":
                    self._learn(msg["index"], msg["step"], None)
                    continue
                if kind == "verdict":  # of a job this rank did not report on (it was taken for dead)
                    self._learn(msg["index"], msg["step"], msg)
                    continue
                self._serve(msg)
        except _Stop:
            return
        except Exception as e:  # noqa: BLE001 - the store broke (rank 0's process, which serves it, is gone?)
            log.warning("fastckpt.remote: rank %d stops serving uploads to %s: %s", self.rank, self.url,
                        _first_line(e))
            with self._cv:
                self._error = f"rank {self.rank} stopped serving uploads: {_first_line(e)}"
        finally:
            with self._cv:
                self._stopped = True
                self._phase, self._job_step = "idle", None
                self._cv.notify_all()
            self._ticker.close(bye=True)

    def _serve(self, job: Dict[str, Any]) -> None:
        n, step = job["n"], job["step"]
        self._ticker.start(n)
        with self._cv:
            self._phase, self._job_step = "uploading", step
        try:
            report = _share(self.remote, job, self.rank, os.path.join(self.directory, job["name"]), self.opts,
                            self.stats)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, raised by wait()
            log.error("fastckpt.remote: rank %d: replicating its part of step %d to %s failed: %s", self.rank,
                      step, self.url, e)
            report = {"error": _text(e)}
            with self._cv:
                self._unraised = e
        finally:
            self._ticker.stop()
        self._board.set(f"rep/{n}/{self.rank}", report)
        self._board.add(f"nrep/{n}", 1)
        with self._cv:
            self._phase = "awaiting"
        verdict = self._next()
        if verdict.get("kind") != "verdict":  # "wake" (closing) or "stop": the outcome is unknown here
            with self._cv:
                self._error, self._error_step = f"the outcome of step {step} is unknown: rank 0 did not say", step
            raise _Stop()
        self._learn(verdict["index"], step, verdict)

    def _learn(self, index: int, step: int, res: Optional[Dict[str, Any]]) -> None:
        with self._cv:
            self._index = max(self._index, index)
            self._phase, self._job_step = "idle", None
            if res is not None:  # None: skipped
                if res.get("ok"):
                    self._last_done, self._error, self._error_step = step, None, None
                else:
                    self._error, self._error_step = res.get("error"), step
                    if self._unraised is None:  # rank 0's verdict (not this rank's own failure)
                        self._unraised = OSError(errno.EIO, res.get("error") or f"step {step} failed", self.url)
            self._cv.notify_all()

    # --- the caller's side
    def status(self) -> Dict[str, Any]:
        """As :meth:`Replicator.status`, from this rank: its job in hand, rank
        0's verdicts, the bytes this rank uploaded."""
        with self._cv:
            return {"url": self.url, "rank": self.rank, "uploading": self._job_step, "queued": None,
                    "last_complete": self._last_done, "last_error": self._error,
                    "last_error_step": self._error_step, "bytes_uploaded": self.stats.bytes}

    def _rank0_gone(self, live: Liveness) -> Optional[str]:
        with self._caller_lock:
            return live.gone([0]).get(0)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Block until rank 0 ruled on every step it had queued when this was
        called; return the newest step complete remotely (as far as this rank
        knows). Raises this rank's failure, or rank 0's verdict that a step
        failed (once); TimeoutError after ``timeout``; RuntimeError when rank 0
        gives no sign of life for peer_timeout meanwhile (while this rank is
        not uploading)."""
        with self._caller_lock:
            q = self._caller.get("submitted") if self._caller.has("submitted") else 0
        deadline = None if timeout is None else time.monotonic() + timeout
        live = Liveness(self._caller, [0], self.timeout)
        with self._cv:
            while self._index < q and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"uploads to {self.url} still running after {timeout} s")
                if self._cv.wait(self.interval if left is None else min(left, self.interval)):
                    continue
                if self._phase == "uploading":  # rank 0 waits for this rank: its own upload is bounded
                    live = Liveness(self._caller, [0], self.timeout)
                    continue
                gone = self._rank0_gone(live)
                if gone:
                    raise RuntimeError(f"fastckpt.remote: rank {self.rank}: waiting for the uploads to "
                                       f"{self.url}: {gone}")
            err, self._unraised = self._unraised, None
            done = self._last_done
            if err is None and self._index < q:  # the thread stopped
                err = RuntimeError(f"fastckpt.remote: rank {self.rank}: {self._error or 'no longer serving uploads'}")
        if err is not None:
            raise err
        return done

    def close(self, wait: bool = True) -> None:
        """Stop serving: with ``wait``, once rank 0 said that no job comes any
        more (or gave no sign of life for peer_timeout while this rank waited
        for it); without, after the part in hand."""
        with self._cv:
            self._closing = True
            self._serve_to_stop = self._serve_to_stop and wait
            self._cv.notify_all()
        live = Liveness(self._caller, [0], self.timeout)
        while True:
            self._thread.join(self.interval if wait else 0)
            if not self._thread.is_alive():
                return
            with self._cv:
                phase = self._phase
            if wait and phase == "uploading":
                live = Liveness(self._caller, [0], self.timeout)
                continue
            gone = self._rank0_gone(live) if wait else "not waiting for rank 0"
            if gone:
                if wait:
                    log.warning("fastckpt.remote: rank %d: closing without rank 0's word that uploads ended: %s",
                                self.rank, gone)
                with self._cv:
                    self._serve_to_stop = False
                    k = self._k
                try:  # wake the thread from its wait for rank 0's next message (the one it waits for, or the next)
                    with self._caller_lock:
                        self._caller.set_many({f"msg/{self.rank}/{i}": {"kind": "wake"} for i in (k, k + 1) if i})
                except Exception as e:  # noqa: BLE001 - the store is gone: so is the thread's wait
                    log.debug("fastckpt.remote: rank %d: could not wake its thread: %s", self.rank, e)
                self._thread.join()
                return


class _Stop(Exception):
    """The worker's thread ends (closing while it waited for a verdict)."""
