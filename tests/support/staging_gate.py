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


def step_in_thread(opt):
    done = threading.Event()

    def run():
        opt.step()
        done.set()

    t = threading.Thread(target=run)
    t.start()
    return t, done
