"""The manager's agreement between ranks (fastckpt.manager.ranks.Ranks.agree) when the exchange
itself breaks: a rank killed while the others still read the collective (gloo: the connection reset)
is a RanksFailed saying what was being agreed, never the backend's bare RuntimeError; a rank's own
error still comes first."""
import errno

import pytest

from fastckpt._core import dist_exit
from fastckpt.errors import RanksFailed
from fastckpt.manager import ranks as ranks_mod


def _two_ranks(monkeypatch):
    r = ranks_mod.Ranks()
    r.dist, r.rank, r.world_size = True, 0, 2

    def broken(out, obj, group=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2461: Connection reset by peer")
    monkeypatch.setattr(dist_exit, "all_gather_object", broken)
    return r


def test_a_broken_exchange_is_ranks_failed_naming_what(monkeypatch):
    r = _two_ranks(monkeypatch)
    with pytest.raises(RanksFailed) as ei:
        r.agree(None, "committing the checkpoint of step 2")
    e = ei.value
    assert isinstance(e, OSError) and isinstance(e, RuntimeError) and e.errno == errno.EIO
    assert "committing the checkpoint of step 2 failed: a rank died or did not answer in time" in str(e)
    assert "Connection reset by peer" in str(e) and e.failures == {}


def test_a_ranks_own_error_comes_first(monkeypatch):
    r = _two_ranks(monkeypatch)
    with pytest.raises(ValueError, match="mine"):
        r.agree(ValueError("mine"), "committing the checkpoint of step 2")
