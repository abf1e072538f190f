"""Background staging held at a gate: Snapshot.complete (the staging thread's copies) waits until
the test opens it, so that "before the copies are complete" does not depend on timing."""
import threading

from fastckpt.staging import snapshot as snapshot_mod


class Gate:
    """Holds every background staging copy until open() (installed on Snapshot.complete)."""

    def __init__(self, monkeypatch, fail=None):
        self.entered = threading.Event()
        self.go = threading.Event()
        orig = snapshot_mod.Snapshot.complete

        def complete(snap):
            self.entered.set()
            assert self.go.wait(60), "the test never opened the gate"
            if fail is not None:
                raise fail
            return orig(snap)

        monkeypatch.setattr(snapshot_mod.Snapshot, "complete", complete)

    def open(self):
        self.go.set()


def step_waits_for(gate, opt, param, before):
    """optimizer.step() of `opt`, in a thread, must wait while `gate` is closed (`param` still equals
    `before`: the state being staged is unchanged), and run once it is opened."""
    import torch
    t, stepped = step_in_thread(opt)
    assert not stepped.wait(0.3), "optimizer.step() ran while the state saved was still being staged"
    assert torch.equal(param.detach(), before)
    gate.open()
    t.join(30)
    assert stepped.is_set()


def step_in_thread(opt):
    done = threading.Event()

    def run():
        opt.step()
        done.set()

    t = threading.Thread(target=run)
    t.start()
    return t, done


class SendGate:
    """Holds the writer thread of a write-through save (fastckpt.staging.through) right after it has
    sent its `after`-th piece of live memory, until open(): that piece's writes may still be in
    flight, and the fence must wait for them. Pieces are made small (`piece` bytes) so that a state
    of a few MiB has several."""

    def __init__(self, monkeypatch, after: int = 1, piece: int = 256 << 10):
        from fastckpt._core.atomic import AtomicFile
        from fastckpt.staging import through as through_mod
        self.entered = threading.Event()
        self.go = threading.Event()
        self.sent = 0
        monkeypatch.setattr(through_mod, "PIECE", piece)
        orig = AtomicFile.write_crc
        gate = self

        def write_crc(f, t, crc, borrow=False):
            out = orig(f, t, crc, borrow)
            if borrow and threading.current_thread().name == "fastckpt-save" and gate._live(t):
                gate.sent += 1
                if gate.sent == after:
                    gate.entered.set()
                    assert gate.go.wait(60), "the test never opened the gate"
            return out

        self.live_ptrs = set()
        monkeypatch.setattr(AtomicFile, "write_crc", write_crc)

    def watch(self, tensors):
        """The live tensors whose pieces count."""
        for t in tensors:
            start = t.untyped_storage().data_ptr()
            self.live_ptrs.add((start, start + t.untyped_storage().nbytes()))

    def _live(self, t) -> bool:
        p = t.data_ptr()
        return any(a <= p < b for a, b in self.live_ptrs)

    def open(self):
        self.go.set()
