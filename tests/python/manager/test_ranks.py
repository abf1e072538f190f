"""The manager's agreement between ranks (fastckpt.manager.ranks.Ranks.agree), the one the
integrations share, when the exchange itself breaks (a rank killed while the others still read the
collective: gloo's connection reset; or a rank that never arrives): a RanksFailed saying what was
being agreed and that contact was lost, with the user's path and what that means for the
checkpoint, never the backend's bare RuntimeError; a rank's own error still comes first."""
import errno

import pytest

from fastckpt._core import dist_exit
from fastckpt.errors import RanksFailed
from fastckpt.manager import ranks as ranks_mod

RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2461: Connection reset by peer"


def _two_ranks(monkeypatch, rank=0, path=None):
    r = ranks_mod.Ranks(path=path)
    r.dist, r.rank, r.world_size = True, rank, 2
    r.pg = r.async_pg = None

    def broken(out, obj, group=None):
        raise RuntimeError(RESET)
    monkeypatch.setattr(dist_exit, "all_gather_object", broken)
    return r


def test_a_broken_exchange_is_ranks_failed_naming_what_and_the_path(monkeypatch):
    r = _two_ranks(monkeypatch)
    with pytest.raises(RanksFailed) as ei:
        r.agree(None, "committing the checkpoint of step 2", path="/ck/step_2", outcome="step 1 is `latest`")
    e = ei.value
    assert isinstance(e, OSError) and isinstance(e, RuntimeError) and e.errno == errno.EIO
    assert e.filename == "/ck/step_2" and e.lost and e.failures == {}
    assert str(e).startswith("[Errno 5] fastckpt.CheckpointManager: committing the checkpoint of step 2 failed: "
                             "lost contact with the other processes (a rank died or did not answer in time: ")
    assert RESET in str(e) and str(e).endswith("; step 1 is `latest`: '/ck/step_2'")
    assert isinstance(e.__cause__, RuntimeError)


def test_a_ranks_own_error_comes_first(monkeypatch):
    r = _two_ranks(monkeypatch)
    own = ValueError("mine")
    with pytest.raises(ValueError) as ei:
        r.agree(own, "committing the checkpoint of step 2")
    assert ei.value is own and RESET in str(ei.value.__cause__)


def test_a_failed_rank_is_named_with_the_directory_the_ranks_share(monkeypatch):
    r = _two_ranks(monkeypatch, rank=1, path="/ck")  # the manager's directory
    monkeypatch.setattr(dist_exit, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [((None, "OSError: disk"), None), obj]))
    with pytest.raises(RanksFailed) as ei:
        r.agree(None, "writing the shards of step 3")
    e = ei.value
    assert not e.lost and e.failures == {0: "OSError: disk"} and e.filename == "/ck"
    assert "writing the shards of step 3 failed on rank 0: OSError: disk" in str(e)


def test_the_async_commits_lost_contact_says_what_latest_names(monkeypatch, tmp_path):
    """The background commit of CheckpointManager.async_save (rank 0 moved `latest`, then the group
    broke): every rank's error names the checkpoint and what it knows of `latest`."""
    from fastckpt.manager import asyncsave
    texts = {}
    for rank in (0, 1):
        r = _two_ranks(monkeypatch, rank)
        path = str(tmp_path / "step_4")
        with pytest.raises(RanksFailed) as ei:
            r.agree(None, f"committing {path} (moving `latest`)", background=True, path=path,
                    outcome=asyncsave.commit_outcome(path, rank))
        texts[rank] = str(ei.value)
    assert texts[0].endswith(f"{tmp_path / 'step_4'} was committed before that; `latest` names it: "
                             f"'{tmp_path / 'step_4'}'")
    assert "this rank cannot tell whether `latest` names it" in texts[1]
