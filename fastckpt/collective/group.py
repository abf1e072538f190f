"""The agreement between ranks, and the group of a collective save or load.

:func:`agree` is fastckpt's one agreement: every rank gathers every rank's
(failure or None, payload), so every rank learns every other rank's failure
and all raise together. A rank that failed raises its own error; the others
raise :class:`~fastckpt.errors.RanksFailed` naming the ranks that failed and
why (:func:`raise_failures`), or, when the exchange itself broke (a rank died
or did not arrive in time), the caller's lost-contact RanksFailed, which says
what that means for the user's checkpoint. The collective saves and loads
(:class:`Group`) and the checkpoint manager (fastckpt/manager/ranks.py) both
agree through it.
"""

import errno
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .._core import dist_exit as _dist_exit
from ..errors import RanksFailed

__all__ = ["Group", "Outcome", "agree", "describe", "raise_failures"]


Outcome = Optional[Tuple[Optional[int], str]]   # None, or a failure: (errno or None, "Type: message")


def describe(e: BaseException) -> Tuple[Optional[int], str]:
    """A failure as another rank sees it: (its errno or None, "Type: message")."""
    return (e.errno if isinstance(e, OSError) else None), f"{type(e).__name__}: {e}"


def raise_failures(outcomes: Sequence[Outcome], message: Callable[[int, str], str],
                   filename: Optional[str] = None) -> None:
    """The agreement's verdict on a rank that had no error of its own: raise
    :class:`~fastckpt.errors.RanksFailed` when any rank's outcome (one per
    rank, in rank order) is a failure. The message is ``message(r, msg)`` of
    the first failed rank r, followed by the others' ranks and causes; the
    errno is that rank's own (EIO when it had none)."""
    failed = {r: o for r, o in enumerate(outcomes) if o is not None}
    if not failed:
        return
    first = min(failed)
    text = message(first, failed[first][1])
    if len(failed) > 1:
        text += " (also failed: " + "; ".join(f"rank {r}: {failed[r][1]}" for r in sorted(failed) if r != first) + ")"
    raise RanksFailed(failed[first][0] or errno.EIO, text, filename, {r: o[1] for r, o in failed.items()})


def agree(gather: Callable[[Any], List[Any]], err: Optional[BaseException], payload: Any,
          failed: Callable[[int, str], str], lost: Callable[[BaseException], RanksFailed],
          filename: Optional[str]) -> List[Any]:
    """One exchange of (this rank's failure or None, ``payload``) through
    ``gather`` (every rank's object, in rank order; a barrier too). Returns
    every rank's payload when no rank failed. Otherwise raises ``err`` on the
    rank that had it, and on every other rank the :class:`RanksFailed` of
    :func:`raise_failures` (message ``failed(r, msg)`` of the first failed
    rank, ``filename`` the user's path). When the exchange itself breaks (a
    rank died: the backend's connection closes; or did not arrive within the
    group's timeout), a rank with an error of its own still raises that, chained
    to the backend's error unless it has a cause of its own, and every other
    rank raises ``lost(the backend's error)``: no rank can tell which died."""
    try:
        got = gather((None if err is None else describe(err), payload))
    except Exception as e:
        if err is not None:
            if err.__cause__ is None:
                raise err from e
            raise err
        raise lost(e) from e
    if err is not None:
        raise err
    raise_failures([o for o, _ in got], failed, filename)
    return [p for _, p in got]


class Group:
    """The collectives of one save; every exchange is an all_gather_object,
    so every rank learns every other rank's failure."""

    def __init__(self, group, path: str, action: str = "save to", outcome: str = "nothing was committed"):
        import torch.distributed as dist
        self.dist, self.group, self.path = dist, group, path
        # the object collectives: torch's, but returning only once gloo's workers let go of their tensors
        self.gather_objects, self.broadcast_objects = _dist_exit.all_gather_object, _dist_exit.broadcast_object_list
        self.action, self.outcome = action, outcome  # for the messages: "cannot <action> <path>: ...; <outcome>"
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        _dist_exit.register()  # a destroyed group that torch still references must not live into finalization

    def exchange(self, mine: Any, local_error: Optional[BaseException], what: str) -> List[Any]:
        """Every rank's ``mine`` (:func:`agree`); raises on every rank when any
        rank failed: ``local_error`` itself on the rank that had it."""
        def gather(obj: Any) -> List[Any]:
            out: List[Any] = [None] * self.world
            self.gather_objects(out, obj, group=self.group)
            return out
        return agree(gather, local_error, mine,
                     lambda r, msg: f"cannot {self.action} {self.path!r}: rank {r} of the group failed {what} "
                                    f"({msg}); {self._failed_outcome(what)}",
                     lambda e: self.lost(e, f"the group's exchange after each rank's attempt {what}", what),
                     self.path)

    def lost(self, e: BaseException, during: str, what: Optional[str] = None) -> RanksFailed:
        """The error for a collective that failed: a rank died, or did not
        arrive within the group's timeout (in the exchange after `what`, if
        given); which rank, no rank can tell (``failures`` is empty)."""
        return RanksFailed(errno.EIO, f"cannot {self.action} {self.path!r}: a rank died or did not answer in time "
                                  f"({during} failed: {type(e).__name__}: {e}); {self._outcome(what)}", self.path)

    def _failed_outcome(self, what: str) -> str:
        """What every rank can say when a rank reported a failure in the step
        before the exchange after `what`: rank 0's commit may fail after its
        rename (the directory fsync), the new file then in place, as with a
        single-process save (docs/ENGINE.md)."""
        if self.action == "save to" and what == "to commit":
            return (f"{self.path!r} holds the previous checkpoint, or the complete new one if rank 0 failed after "
                    "its rename (in the directory fsync)")
        return self.outcome

    def _outcome(self, what: Optional[str]) -> str:
        """What this rank can say about the file when the group broke (a rank
        died or timed out) in the save's exchange after `what` and this rank had
        no error of its own. Rank 0 commits after the exchange "to write its
        share" and before the one "to commit": there, without an error, it has
        committed. Another rank that loses the group in either of those two
        exchanges cannot know whether rank 0 got that far; before them, rank 0
        cannot have. (Loads, and other stages: self.outcome.)"""
        if self.action != "save to":
            return self.outcome
        if what == "to commit" and self.rank == 0:
            return f"the new checkpoint at {self.path!r} was committed (complete and durable) before that"
        if what == "to commit" and self.rank != 0:
            return (f"{self.path!r} holds either the previous checkpoint or the complete new one (rank 0 may "
                    "have committed before the group broke)")
        if what == "to write its share" and self.rank != 0:
            return (f"nothing was committed unless rank 0 had every rank's share result before the group broke "
                    f"({self.path!r} holds the previous checkpoint or, if rank 0 committed, the complete new one)")
        return self.outcome
