"""Replacing a checkpoint that is a directory or a set of files is atomic.

Every writer of directories (the sharded CheckpointManager re-saving a step, ``fastckpt convert
--to dcp --force``, ``fastckpt.safetensors.save_sharded`` and ``dcp.save`` with ``FastWriter``
over an existing checkpoint) re-saves a checkpoint in a child process that strace kills with
SIGKILL at the k-th ``rename``/``renameat``/``renameat2``/``unlink``/``unlinkat``/``rmdir`` of
its main thread, for every k up to the number the save makes: a crash at each step that changes
a directory. After each kill: fastckpt's reader of that kind loads the old checkpoint or the
complete new one (with the exchange, from the final name itself: it never goes missing); then
the next start's cleanup of temporaries (``CheckpointManager``'s, on the parent directory)
leaves the final name loadable, old or new, with nothing of either lost. The same with the
exchange refused (the test-only ``FASTCKPT_TEST_NO_EXCHANGE=1``: the two-rename fallback of a
filesystem without ``RENAME_EXCHANGE``), where the final name may be missing between the two
renames but fastckpt's readers find the copy left aside and the cleanup renames it back.

Also the helper itself (fastckpt/_core/dircommit.py): exchange, fallback, a failed second rename,
carried files, refusal of a non-directory, and cleanup that renames an only copy back.
"""
import errno
import json
import os
import shutil
import signal
import subprocess
import time
import traceback
import warnings

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt.manager.policy import StepDirectory

STRACE = shutil.which("strace")
CALLS = ("rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir")
KINDS = ("manager", "convert", "save_sharded", "dcp")
STEP = "step_00000001"


def state(gen: int) -> dict:
    return {"w": torch.full((128, 128), float(gen)), "v": torch.arange(4000, dtype=torch.float32) + gen,
            "u": torch.full((96, 96), -float(gen))}


def blank() -> dict:
    return {k: torch.zeros_like(v) for k, v in state(0).items()}


def target(kind: str, work: str) -> str:
    return os.path.join(work, "run", STEP) if kind == "manager" else os.path.join(work, "ckpt")


def save(kind: str, work: str, gen: int) -> None:
    """One (re-)save of generation ``gen`` by writer ``kind``."""
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "manager":
            m = fastckpt.CheckpointManager(os.path.join(work, "run"), keep_last=None, sharded=True)
            m.save(1, state(gen))
            m.close()
        elif kind == "convert":
            from fastckpt.cli.command import main
            src = os.path.join(work, f"src{gen}.pt")
            if not os.path.exists(src):
                fastckpt.save(state(gen), src)
            args = ["convert", src, target(kind, work), "--to", "dcp", "--quiet"]
            rc = main(args + (["--force"] if os.path.exists(target(kind, work)) else []))
            assert rc == 0
        elif kind == "save_sharded":
            import fastckpt.safetensors as fst
            d = target(kind, work)
            fst.save_sharded(state(gen), d, max_shard_size="40KB")
            if not os.path.exists(os.path.join(d, "config.json")):
                with open(os.path.join(d, "config.json"), "w") as f:
                    f.write('{"model": 1}')
        else:
            dcp.save(state(gen), storage_writer=FastWriter(target(kind, work)))


def loaded(kind: str, work: str):
    """The generation fastckpt's reader of this kind loads from the target (exactly), or a string
    saying what went wrong."""
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastReader
    d = target(kind, work)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "save_sharded":
                import fastckpt.safetensors as fst
                sd = fst.load_sharded(d)
            else:
                sd = blank()
                dcp.load(sd, storage_reader=FastReader(d))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - reported as the outcome (DCP's CheckpointException too)
        return f"{type(e).__name__}: {str(e)[:300]}"
    g = int(sd["w"][0, 0].item())
    want = state(g)
    if set(sd) != set(want) or not all(torch.equal(sd[k], want[k]) for k in want):
        return f"torn (w says generation {g})"
    return g


def clean(kind: str, work: str) -> None:
    """The next start's cleanup of temporaries in the directory that holds the target."""
    StepDirectory(os.path.dirname(target(kind, work)), None, sharded=True).clean_temporaries()


# ------------------------------------------------------------------ killing at every step

def _wait_traced(pid: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(f"/proc/{pid}/status") as f:
            if any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f):
                return
        time.sleep(0.005)
    raise RuntimeError("strace did not attach")


def run_traced(kind: str, work: str, gen: int, inject=None, trace_out=None, env=None) -> int:
    """Fork a child that re-saves ``gen`` once strace is attached to it (its main thread only);
    ``inject``: (syscall, k) to SIGKILL it at the k-th call. Returns the child's wait status."""
    r, w = os.pipe()
    err_path = os.path.join(work, "child_error.txt")
    pid = os.fork()
    if pid == 0:  # the child: wait for strace, save, leave without running the parent's atexit
        os.close(w)
        code = 0
        try:
            os.read(r, 1)
            os.environ.update(env or {})
            save(kind, work, gen)
        except BaseException:  # noqa: BLE001
            with open(err_path, "w") as f:
                f.write(traceback.format_exc())
            code = 3
        os._exit(code)
    os.close(r)
    cmd = [STRACE, "-qq", "-p", str(pid), "-e", "trace=" + ",".join(CALLS), "-o", trace_out or os.devnull]
    if inject:
        cmd += ["-e", f"inject={inject[0]}:signal=SIGKILL:when={inject[1]}"]
    tracer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_traced(pid)
        os.write(w, b"g")
        os.close(w)
        _, status = os.waitpid(pid, 0)
    finally:
        tracer.wait(timeout=30)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
        with open(err_path) as f:
            raise AssertionError(f"the {kind} save failed:\n{f.read()}")
    return status


def _count(trace_file: str) -> dict:
    counts = dict.fromkeys(CALLS, 0)
    with open(trace_file) as f:
        for line in f:
            name = line.split("(", 1)[0].strip()
            if name in counts:
                counts[name] += 1
    return counts


def kill_everywhere(kind: str, tmp_path, env=None):
    """Re-save over generation 1 killed at every step; returns (kills, violations)."""
    if STRACE is None:
        pytest.skip("strace is not installed")
    template = str(tmp_path / "template")
    os.makedirs(os.path.dirname(target(kind, template)), exist_ok=True)
    save(kind, template, 1)
    assert loaded(kind, template) == 1
    if kind == "convert":  # the source of the re-save, made beforehand
        fastckpt.save(state(2), os.path.join(template, "src2.pt"))

    def fresh(name):
        work = str(tmp_path / name)
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work, symlinks=True)
        return work

    work = fresh("count")
    trace = str(tmp_path / "trace.txt")
    status = run_traced(kind, work, 2, trace_out=trace, env=env)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert loaded(kind, work) == 2
    counts = _count(trace)
    assert sum(counts.values()) >= 3, counts  # the files' renames, the commit, the old copy's removal
    strict = not (env or {}).get("FASTCKPT_TEST_NO_EXCHANGE")
    violations, kills = [], 0
    for call, n in counts.items():
        for k in range(1, n + 1):
            work = fresh("w")
            status = run_traced(kind, work, 2, inject=(call, k), env=env)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            kills += killed
            where = f"{kind}, killed at {call} #{k}"
            got = loaded(kind, work)
            if got not in (1, 2):
                violations.append(f"{where}: the target does not load ({got}); left: {sorted(os.listdir(os.path.dirname(target(kind, work))))}")
            if strict and not os.path.isdir(target(kind, work)):
                violations.append(f"{where}: the final name is missing (the exchange never leaves it so)")
            clean(kind, work)
            after = loaded(kind, work)
            if after not in (1, 2) or not os.path.isdir(target(kind, work)):
                violations.append(f"{where}: after the cleanup the target does not load ({after})")
            elif got in (1, 2) and after != got:
                violations.append(f"{where}: loaded generation {got} before the cleanup, {after} after it")
            if kind == "save_sharded" and after in (1, 2):
                if not os.path.isfile(os.path.join(target(kind, work), "config.json")):
                    violations.append(f"{where}: config.json, beside the shards, was lost")
    assert kills > 0
    return kills, violations


@pytest.mark.parametrize("kind", KINDS)
def test_a_resave_killed_at_any_step_leaves_old_or_new(kind, tmp_path):
    kills, violations = kill_everywhere(kind, tmp_path)
    print(f"{kind}: {kills} kills, {len(violations)} violations")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("kind", KINDS)
def test_the_fallback_killed_at_any_step_leaves_old_or_new(kind, tmp_path):
    kills, violations = kill_everywhere(kind, tmp_path, env={"FASTCKPT_TEST_NO_EXCHANGE": "1"})
    print(f"{kind} (fallback): {kills} kills, {len(violations)} violations")
    assert not violations, "\n".join(violations)


# ------------------------------------------------------------------ the helper

def _dir(path, files):
    os.makedirs(path)
    for n, data in files.items():
        with open(os.path.join(path, n), "wb") as f:
            f.write(data)


def _exchange_offered(tmp_path) -> bool:
    a, b = tmp_path / "probe_a", tmp_path / "probe_b"
    a.mkdir()
    b.mkdir()
    ok = _C.rename_exchange(str(a), str(b))
    shutil.rmtree(a)
    shutil.rmtree(b)
    return ok


def test_commit_new_then_exchange_then_fallback(tmp_path, monkeypatch):
    from fastckpt._core import dircommit
    final = tmp_path / "ck"
    tmp = dircommit.new_directory(final)
    _dir(os.path.join(tmp, "sub"), {"a": b"1"})
    assert dircommit.commit_directory(tmp, final) == "rename"
    assert os.listdir(final) == ["sub"] and os.listdir(tmp_path) == ["ck"]
    tmp = dircommit.new_directory(final)
    _dir(os.path.join(tmp, "n"), {})
    how = dircommit.commit_directory(tmp, final)
    assert how == ("exchange" if _exchange_offered(tmp_path) else "fallback")
    assert os.listdir(final) == ["n"] and os.listdir(tmp_path) == ["ck"]
    monkeypatch.setenv("FASTCKPT_TEST_NO_EXCHANGE", "1")
    tmp = dircommit.new_directory(final)
    assert dircommit.commit_directory(tmp, final) == "fallback"
    assert os.listdir(final) == [] and os.listdir(tmp_path) == ["ck"]


def test_an_injected_refusal_takes_the_fallback(tmp_path):
    from fastckpt._core import dircommit
    final = tmp_path / "ck"
    _dir(final, {"old": b"o"})
    tmp = dircommit.new_directory(final)
    _dir(os.path.join(tmp, "d"), {"new": b"n"})
    _C.fault_inject("rename", nth=1, errno=errno.EINVAL, path_contains=str(final))
    try:
        assert dircommit.commit_directory(tmp, final) == "fallback"
        assert _C.fault_fired() == 1
    finally:
        _C.fault_clear()
    assert os.listdir(final) == ["d"] and os.listdir(tmp_path) == ["ck"]


def test_a_failed_second_rename_puts_the_old_copy_back(tmp_path, monkeypatch):
    from fastckpt._core import dircommit
    monkeypatch.setenv("FASTCKPT_TEST_NO_EXCHANGE", "1")
    final = tmp_path / "ck"
    _dir(final, {"old": b"o"})
    tmp = dircommit.new_directory(final)
    _dir(os.path.join(tmp, "d"), {})
    # renames: final -> aside (#1), tmp -> final (#2, fails), aside -> final (#3)
    _C.fault_inject("rename", nth=2, errno=errno.EIO)
    try:
        with pytest.raises(OSError) as ei:
            dircommit.commit_directory(tmp, final)
    finally:
        _C.fault_clear()
    assert ei.value.errno == errno.EIO and str(final) in str(ei.value)
    assert os.listdir(final) == ["old"]


def test_carried_entries_and_a_refused_target(tmp_path):
    from fastckpt._core import dircommit
    final = tmp_path / "ck"
    _dir(final, {"config.json": b"{}", "model.safetensors": b"old"})
    _dir(final / "tok", {"vocab": b"v"})
    os.chmod(final, 0o750)
    tmp = dircommit.new_directory(final)
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(b"new")
    dircommit.commit_directory(tmp, final, keep=lambda n: n != "model.safetensors")
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors", "tok"]
    assert (final / "model.safetensors").read_bytes() == b"new" and (final / "tok" / "vocab").read_bytes() == b"v"
    assert os.stat(final).st_mode & 0o777 == 0o750
    (tmp_path / "f").write_bytes(b"x")
    tmp = dircommit.new_directory(tmp_path / "f")
    with pytest.raises(NotADirectoryError):
        dircommit.commit_directory(tmp, tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"x"


def _aside_of_a_dead_process(parent, name, files):
    """An ``.old`` copy of ``name`` as a crashed fallback commit leaves it (made by a process that is gone)."""
    from fastckpt._core.tempnames import temp_name
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, temp_name(name, "old").encode())
        os._exit(0)
    os.close(w)
    aside = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    _dir(os.path.join(parent, aside), files)
    return aside


def test_cleanup_renames_an_only_copy_back_and_readers_find_it(tmp_path):
    from fastckpt._core import dircommit
    aside = _aside_of_a_dead_process(tmp_path, "ck", {"a": b"1"})
    assert dircommit.resolve(tmp_path / "ck") == str(tmp_path / aside)  # a reader finds it, moving nothing
    assert os.listdir(tmp_path) == [aside]
    StepDirectory(tmp_path, None, sharded=True).clean_temporaries()
    assert os.listdir(tmp_path) == ["ck"] and os.listdir(tmp_path / "ck") == ["a"]
    # beside a final name that exists, an .old copy is the replaced one: removed
    aside = _aside_of_a_dead_process(tmp_path, "ck", {"b": b"2"})
    StepDirectory(tmp_path, None, sharded=True).clean_temporaries()
    assert os.listdir(tmp_path) == ["ck"] and os.listdir(tmp_path / "ck") == ["a"]
    # the next commit of the same target puts an only copy back before replacing it
    os.rename(tmp_path / "ck", tmp_path / _aside_of_a_dead_process(tmp_path, "ck", {}))
    tmp = dircommit.new_directory(tmp_path / "ck")
    dircommit.commit_directory(tmp, tmp_path / "ck")
    assert os.listdir(tmp_path) == ["ck"] and os.listdir(tmp_path / "ck") == []


def test_an_only_copy_whose_name_holds_only_a_hash_is_kept_until_its_name_is_known(tmp_path):
    """A target name longer than a temporary name can spell out (64 bytes) is named by its hash: a
    cleanup cannot tell which final name a missing checkpoint had, so it keeps the only copy; a
    reader of that name finds it, and the name's next recovery or commit puts it back."""
    from fastckpt._core import dircommit
    from fastckpt._core.tempnames import parse_temp
    name = "a-checkpoint-directory-of-a-framework-with-a-long-descriptive-name-epoch=3"
    assert len(name) > 64
    aside = _aside_of_a_dead_process(tmp_path, name, {"a": b"1"})
    assert parse_temp(aside).target is None and parse_temp(aside).is_for(name)
    StepDirectory(tmp_path, None, sharded=True).clean_temporaries()
    assert os.listdir(tmp_path) == [aside]  # kept: the only copy of a name the cleanup cannot know
    assert dircommit.resolve(tmp_path / name) == str(tmp_path / aside)
    assert dircommit.resolve(tmp_path / (name + "x")) == str(tmp_path / (name + "x"))  # another name's: not it
    assert dircommit.recover(tmp_path / name) == str(tmp_path / name)
    assert os.listdir(tmp_path) == [name] and os.listdir(tmp_path / name) == ["a"]
    # beside its final name, the hashed copy is the replaced one: removed
    _aside_of_a_dead_process(tmp_path, name, {"b": b"2"})
    StepDirectory(tmp_path, None, sharded=True).clean_temporaries()
    assert os.listdir(tmp_path) == [name] and os.listdir(tmp_path / name) == ["a"]


def test_save_sharded_keeps_other_files_and_drops_stale_shards(tmp_path):
    import fastckpt.safetensors as fst
    d = tmp_path / "m"
    fst.save_sharded(state(1), d, max_shard_size="20KB")
    (d / "config.json").write_text(json.dumps({"a": 1}))
    n_old = len([f for f in os.listdir(d) if f.endswith(".safetensors")])
    fst.save_sharded(state(2), d, max_shard_size="100KB")
    names = sorted(os.listdir(d))
    assert "config.json" in names
    shards = [f for f in names if f.endswith(".safetensors")]
    assert 1 < len(shards) < n_old  # the old set's extra shards are gone
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert torch.equal(fst.load_sharded(d)["w"], state(2)["w"])
    assert os.listdir(tmp_path) == ["m"]
