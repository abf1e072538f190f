"""The job's key-value store as the remote team's message board: JSON values
under a key prefix (:class:`Board`), a working rank's signs of life
(:class:`Ticker`, key ``hb/<rank>``) and rank 0's view of which ranks stopped
showing them (:class:`Liveness`). The keys' meaning is :mod:`fastckpt.remote.team`'s."""

import datetime
import json
import logging
import threading
import time
from typing import Any, Dict, List, Optional

__all__ = ["Board", "Ticker", "Liveness", "heartbeat_interval"]

log = logging.getLogger("fastckpt.remote")


def heartbeat_interval(timeout: float) -> float:
    """How often a working rank shows it lives, and how long one wait on the store lasts."""
    return max(0.1, min(5.0, timeout / 6.0))


class Board:
    """JSON values under a key prefix of a c10d Store; one per thread (:meth:`clone`)."""

    def __init__(self, store: Any, prefix: str):
        self._store, self.prefix = store, prefix.rstrip("/")

    def clone(self) -> "Board":
        return Board(self._store.clone(), self.prefix)

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._k(key), json.dumps(value))

    def get(self, key: str) -> Any:
        return json.loads(self._store.get(self._k(key)))

    def get_many(self, keys: List[str], default: Any = None) -> List[Any]:
        """The keys' values (``default`` for a key not there: never blocks)."""
        full = [self._k(k) for k in keys]
        if self._store.check(full):
            return [json.loads(v) for v in self._store.multi_get(full)]
        return [json.loads(self._store.get(k)) if self._store.check([k]) else default for k in full]

    def has(self, key: str) -> bool:
        return bool(self._store.check([self._k(key)]))

    def set_many(self, items: Dict[str, Any]) -> None:
        keys = list(items)
        self._store.multi_set([self._k(k) for k in keys], [json.dumps(items[k]) for k in keys])

    def add(self, key: str, n: int) -> int:
        return int(self._store.add(self._k(key), n))

    def wait_for(self, key: str) -> Any:
        """The value of ``key`` once it is set: one long wait (a day at a time),
        never a poll: a c10d store logs every timed-out wait."""
        while True:
            try:
                self._store.wait([self._k(key)], datetime.timedelta(days=1))
                return self.get(key)
            except Exception as e:  # noqa: BLE001 - the stores' timeouts are RuntimeErrors of several kinds
                if type(e).__name__ == "DistNetworkError" or "timeout" not in str(e).split("\n", 1)[0].lower():
                    raise

    def delete(self, keys: List[str]) -> None:
        for k in keys:
            try:
                self._store.delete_key(self._k(k))
            except Exception:  # noqa: BLE001 - a store without deletion keeps them
                return


class Ticker:
    """Sets ``hb/<rank>`` every ``interval`` seconds while a job is in hand."""

    def __init__(self, board: Board, rank: int, interval: float):
        self._board, self._key, self._interval = board, f"hb/{rank}", interval
        self._cv = threading.Condition()
        self._job: Optional[int] = None
        self._count = 0
        self._closed = False
        self._board.set(self._key, "0")  # exists from the start: others read it without waiting
        self._thread = threading.Thread(target=self._run, name=f"fastckpt-remote-hb{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        try:
            self._board.set(self._key, f"{self._job}:{self._count}")
        except Exception as e:  # noqa: BLE001 - the job's own store calls will report it
            log.debug("fastckpt.remote: sign of life not sent: %s", e)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._job is not None:
                    self._beat()
                self._cv.wait(self._interval if self._job is not None else None)

    def start(self, job: int) -> None:
        with self._cv:
            self._job = job
            self._beat()
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._job = None

    def close(self, bye: bool = False) -> None:
        with self._cv:
            self._closed = True
            self._job = None
            self._cv.notify_all()
        self._thread.join()
        if bye:
            try:
                self._board.set(self._key, "bye")
            except Exception:  # noqa: BLE001 - rank 0's store may be gone already
                pass


class Liveness:
    """Which of some ranks stopped showing signs of life (``hb/<r>``
    unchanged for ``timeout`` seconds, or "bye")."""

    def __init__(self, board: Board, ranks, timeout: float):
        self._board, self._timeout = board, timeout
        now = time.monotonic()
        self._seen = {r: (None, now) for r in ranks}

    def gone(self, ranks) -> Dict[int, str]:
        ranks = sorted(ranks)
        if not ranks:
            return {}
        now = time.monotonic()
        out = {}
        for r, v in zip(ranks, self._board.get_many([f"hb/{r}" for r in ranks])):
            last, since = self._seen.get(r, (None, now))
            if v == "bye":
                out[r] = f"rank {r} stopped (its manager was closed or its process is exiting)"
            elif v != last:
                self._seen[r] = (v, now)
            elif now - since > self._timeout:
                out[r] = (f"rank {r} gave no sign of life for {now - since:.0f} s (peer_timeout "
                          f"{self._timeout:g} s): it died or hangs")
        return out
