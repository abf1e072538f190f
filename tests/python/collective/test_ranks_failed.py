"""One error for "rank r failed" (fastckpt.errors.RanksFailed): the collective
group's exchange, the manager's agreement and the remote team raise it, an
OSError (EIO unless the rank's own errno) and a RuntimeError naming each
failed rank and its cause."""

import errno
import pickle

import pytest

from fastckpt.collective import group as _group
from fastckpt.errors import RanksFailed
from fastckpt.manager import ranks as _ranks
from fastckpt.remote import team


class _FakeDist:
    def __init__(self, others):
        self.others = others

    def gather_objects(self, out, payload, group=None):
        out[:] = [payload] + self.others


def _group_of(others):
    g = object.__new__(_group.Group)
    g.dist, g.group, g.path = None, None, "/ckpt/x.pt"
    g.gather_objects = _FakeDist(others).gather_objects
    g.action, g.outcome, g.rank, g.world = "save to", "nothing was committed", 0, 1 + len(others)
    return g


def test_the_group_names_every_failed_rank():
    g = _group_of([((errno.ENOSPC, "OSError: no space"), None), (None, 2), ((None, "ValueError: bad"), None)])
    with pytest.raises(RanksFailed) as ei:
        g.exchange(0, None, "to write its share")
    e = ei.value
    assert isinstance(e, OSError) and isinstance(e, RuntimeError)
    assert e.errno == errno.ENOSPC and e.filename == "/ckpt/x.pt" and e.failures == {1: "OSError: no space",
                                                                                       3: "ValueError: bad"}
    assert "rank 1 of the group failed to write its share (OSError: no space)" in str(e)
    assert "also failed: rank 3: ValueError: bad" in str(e)


def test_no_failure_returns_the_payloads_and_a_lost_group_is_eio():
    assert _group_of([(None, 1)]).exchange(0, None, "to plan") == [0, 1]
    lost = _group_of([]).lost(TimeoutError("late"), "the exchange", "to plan")
    assert isinstance(lost, RanksFailed) and lost.errno == errno.EIO and lost.failures == {}


def test_the_managers_agreement_raises_the_same_type():
    assert _ranks.PeerFailed is RanksFailed and team.RanksFailed is RanksFailed
    r = _ranks.Ranks()
    r.gather = lambda obj, background=False: [obj, ((errno.ENOSPC, "OSError: [Errno 28] full"), None)]
    with pytest.raises(RanksFailed, match="fastckpt: saving x failed on rank 1: OSError: \\[Errno 28\\] full") as ei:
        r.agree(None, "saving x", who="fastckpt")
    # the failed rank's own errno, as the collective group's exchange gives it (one agreement)
    assert ei.value.errno == errno.ENOSPC and ei.value.failures == {1: "OSError: [Errno 28] full"}
    r.gather = lambda obj, background=False: [obj, ((None, "ValueError: bad"), None)]
    with pytest.raises(RanksFailed) as ei:
        r.agree(None, "saving x", who="fastckpt")
    assert ei.value.errno == errno.EIO


def test_it_pickles():
    e = RanksFailed(errno.EIO, "step 3 was not replicated", "s3://b/x", {1: "gone"})
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is RanksFailed and back.errno == errno.EIO and str(back) == str(e)


def _broken_group():
    g = _group_of([(None, 1)])

    def broken(out, payload, group=None):
        raise RuntimeError("Connection reset by peer")
    g.gather_objects = broken
    return g


def test_a_broken_exchange_raises_the_ranks_own_error_first_keeping_its_cause():
    """One agreement (collective/group.py agree) for the group and the manager: when the exchange
    breaks, a rank's own error comes first, chained to the backend's unless it has a cause of its own."""
    own = OSError(errno.ENOSPC, "no space")
    with pytest.raises(OSError) as ei:
        _broken_group().exchange(0, own, "to write its share")
    assert ei.value is own and "Connection reset" in str(own.__cause__)
    inner = ValueError("the engine's")
    caused = OSError(errno.EIO, "write failed")
    caused.__cause__ = inner
    with pytest.raises(OSError) as ei:
        _broken_group().exchange(0, caused, "to write its share")
    assert ei.value is caused and caused.__cause__ is inner
    with pytest.raises(RanksFailed) as ei:
        _broken_group().exchange(0, None, "to commit")
    e = ei.value
    assert e.lost and e.errno == errno.EIO and e.filename == "/ckpt/x.pt" and "Connection reset" in str(e)
    assert "a rank died or did not answer in time" in str(e) and isinstance(e.__cause__, RuntimeError)
