"""fastckpt.staging.through on its own: the hand-over of a snapshot's live sources between a writer and
the fence, driven with a sink that records what it is asked (no engine, no saver)."""
import threading

import torch

from fastckpt.staging.snapshot import Snapshotter
from fastckpt.staging.through import Through, Waited, eligible

from states import page_aligned

MIB = 1 << 20


class Sink:
    """Records the writer's calls; `drain` counts (a real sink waits for its writes there)."""

    def __init__(self):
        self.calls = []
        self.data = bytearray()
        self.checksums = True

    def write_crc(self, t, crc, borrow=False):
        import zlib
        b = t.numpy().tobytes()
        self.calls.append(("write_crc", len(b)))
        self.data += b
        return zlib.crc32(b, crc)

    def write(self, t, borrow=False):
        b = t.numpy().tobytes()
        self.calls.append(("write", len(b)))
        self.data += b

    def drain(self):
        self.calls.append(("drain",))


def _snapshot(sources):
    snap = Snapshotter().take(sources, defer_over=MIB)
    live = [job for job in snap.pending if eligible(job[1], job[2])]
    rest = [job for job in snap.pending if not eligible(job[1], job[2])]
    return snap, live, rest


def test_the_fence_does_not_wait_for_a_staged_source_the_writer_waits_for():
    """The writer has sent a live source and waits for the staging thread's copy of the next one:
    a fence then copies the other live sources and returns once the writer has let go of the live
    memory (a drain), without waiting for that staged source."""
    g = torch.Generator().manual_seed(0)
    a = page_aligned(torch.randn(MIB // 2, generator=g))          # 2 MiB, page-aligned: sent live
    odd = page_aligned(torch.randn(MIB // 4 + 99, generator=g), 64)  # off the phase: copied by the stager
    c = page_aligned(torch.randn(MIB // 2, generator=g))          # sent live, or copied by the fence
    snap, live, rest = _snapshot([a.untyped_storage(), odd.untyped_storage(), c.untyped_storage()])
    assert [j[0] for j in live] == [0, 2] and [j[0] for j in rest] == [1]
    h = Through(live)
    snap.pending = rest  # as the saver hands them out: the staging thread copies the others only
    waiting = threading.Event()

    class Held(threading.Event):  # the staging thread's copy of `odd`, held back
        def wait(self, timeout=None):
            waiting.set()  # the writer has sent `a` and waits for it
            return super().wait(timeout)

    staged_copy = Held()
    w = Waited(snap.views[1], 1, snap.crcs, staged_copy, lambda: None, h)
    sink = Sink()

    def writer():
        h.source(0).write_into(sink)
        w.write_into(sink)
        h.source(2).write_into(sink)
        h.finish()

    t = threading.Thread(target=writer)
    t.start()
    assert waiting.wait(10)
    done = threading.Event()
    f = threading.Thread(target=lambda: (h.fence(), done.set()))
    f.start()
    assert done.wait(10), "the fence waited for the staging thread's copy of another source"
    assert ("drain",) in sink.calls and h.done.is_set()
    c.mul_(-1)  # the caller changes a live source after the fence: not in the file
    snap.complete()  # the staging thread copies `odd` (with its CRC)
    staged_copy.set()
    t.join(10)
    f.join(10)
    want = b"".join(x.numpy().tobytes() for x in (a, odd, -c))
    assert bytes(sink.data) == want
    assert h.copied_bytes == c.numel() * 4 and h.live_bytes >= a.numel() * 4
    snap.release()


def test_a_fence_in_the_middle_of_a_source_copies_only_the_pieces_not_yet_handed_to_a_write():
    """A source of several pieces: the fence comes while the writer's second piece is in flight. It
    copies from the third piece on (not the two already taken), waits for the write in flight, and
    the writer sends the rest from the arena; the CRC it returns is the whole source's, joined from
    the pieces it sent and the fence's CRC of the rest. A change after the fence is in no byte."""
    import zlib

    from fastckpt.staging.through import PIECE

    g = torch.Generator().manual_seed(1)
    big = page_aligned(torch.randn((2 * PIECE + 3 * MIB + 4096) // 4, generator=g))
    want = big.numpy().tobytes()
    snap, live, rest = _snapshot([big.untyped_storage()])
    assert [j[0] for j in live] == [0] and rest == []
    h = Through(live)
    snap.pending = []

    in_second, go_on = threading.Event(), threading.Event()

    class Slow(Sink):
        def write_crc(self, t, crc, borrow=False):
            if len(self.calls) == 1:  # the second piece: in flight until the fence has copied
                in_second.set()
                assert go_on.wait(10)
            return super().write_crc(t, crc, borrow)

    sink = Slow()
    got = {}
    t = threading.Thread(target=lambda: (got.setdefault("crc", h.source(0).write_into(sink)), h.finish()))
    t.start()
    assert in_second.wait(10)
    f = threading.Thread(target=h.fence)
    f.start()
    deadline = threading.Event()
    while not h.fenced and not deadline.wait(0.01):
        pass
    assert h.fenced
    f.join(0.3)
    assert f.is_alive(), "the fence returned while a write from the live memory was in flight"
    go_on.set()
    f.join(10)
    assert not f.is_alive() and h.done.is_set()
    big.mul_(-1)  # after the fence: none of this reaches the file
    t.join(10)
    assert h.copied_bytes == len(want) - 2 * PIECE
    assert h.live_bytes == 2 * PIECE
    assert [c for c in sink.calls if c[0] != "drain"] == [("write_crc", PIECE), ("write_crc", PIECE),
                                                         ("write", len(want) - 2 * PIECE)]
    assert bytes(sink.data) == want
    assert got["crc"] == zlib.crc32(want)
    snap.release()
