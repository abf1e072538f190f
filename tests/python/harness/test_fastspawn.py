"""The tests' process launcher (fastspawn.py): a forked child behaves as the fresh interpreter it
replaces in what the tests rely on (argv, environment, cwd, sys.path, streams, exit status, signals,
threads and atexit at exit, __main__), and commands that need a fresh interpreter get one."""
import os
import signal
import subprocess
import sys
import time

import pytest

import fastspawn


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def test_a_command_runs_forked_with_its_argv_env_cwd_and_path(tmp_path):
    code = ("import json, os, sys, torch\n"
            "print(json.dumps([sys.argv, os.environ['FS_PROBE'], os.getcwd(), sys.path[:2], __name__,"
            " torch.get_num_threads()]))\n"
            "sys.stderr.write('to stderr\\n')\n")
    p = fastspawn.Popen([sys.executable, "-c", code, "a", "b"], env=_env(FS_PROBE="x", PYTHONPATH="/nowhere"),
                        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.forked and p.returncode == 0, err
    import json
    argv, probe, cwd, path, name, threads = json.loads(out)
    assert argv == ["-c", "a", "b"] and probe == "x" and cwd == str(tmp_path)
    assert path == ["", "/nowhere"] and name == "__main__" and threads == 1
    assert err == "to stderr\n"


def test_a_script_is_main_with_its_file_and_directory_first(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import pickle, sys\nclass A:\n    pass\n"
                      "print(__name__, __file__ == sys.argv[0], sys.path[0], sys.argv[1:], "
                      "type(pickle.loads(pickle.dumps(A()))).__module__)\n")
    r = fastspawn.run([sys.executable, str(script), "x"], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["__main__", "True", str(tmp_path), "['x']", "__main__"]


@pytest.mark.parametrize("code,status", [("import sys; sys.exit(3)", 3), ("raise SystemExit", 0),
                                         ("raise ValueError('boom')", 1), ("import sys; sys.exit('msg')", 1),
                                         ("import os; os._exit(7)", 7),
                                         ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                                          -signal.SIGKILL)])
def test_exit_statuses_are_a_fresh_interpreters(code, status):
    r = fastspawn.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == status, r.stderr
    if "boom" in code:
        assert "ValueError: boom" in r.stderr and "Traceback" in r.stderr
    if "msg" in code:
        assert r.stderr.strip() == "msg"


def test_threads_are_joined_then_atexit_runs():
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n"
            "print('main', flush=True)\n")
    r = fastspawn.run([sys.executable, "-u", "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["main", "thread", "atexit"]), r.stderr


def test_wait_poll_kill_and_signals():
    p = fastspawn.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                        env=_env(), stdout=subprocess.PIPE, text=True)
    assert p.forked
    assert p.stdout.readline() == "up\n"
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.kill(p.pid, 0)  # the real process
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    p.stdout.close()
    p = fastspawn.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=_env())
    time.sleep(0.2)
    p.kill()
    assert p.wait(30) == -signal.SIGKILL
    p.kill()  # already reaped: nothing is signalled


def test_input_and_a_child_that_reads_stdin():
    r = fastspawn.run([sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"], env=_env(),
                      input="abc", capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "ABC\n")


def test_modules_run_with_dash_m():
    r = fastspawn.run([sys.executable, "-m", "json.tool"], env=_env(), input='{"a": 1}', capture_output=True,
                      text=True, timeout=60)
    assert r.returncode == 0 and '"a": 1' in r.stdout, r.stderr


def test_an_inherited_stderr_is_not_the_stdout_pipe(tmp_path):
    err = open(tmp_path / "err", "w+")
    import os as _os
    saved = _os.dup(2)
    _os.dup2(err.fileno(), 2)  # this process's stderr, which the child inherits
    try:
        p = fastspawn.Popen([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                            env=_env(), stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=60)
    finally:
        _os.dup2(saved, 2)
        _os.close(saved)
    assert p.forked and out == "out\n"
    err.seek(0)
    assert err.read() == "err\n"


@pytest.mark.parametrize("args,env", [(["-X", "dev", "-c", "pass"], {}), (["-c", "pass"], {"PYTHONHASHSEED": "7"}),
                                      (["-c", "pass"], {"MALLOC_MMAP_THRESHOLD_": "131072"}),
                                      (["-c", "pass"], {"FASTCKPT_TEST_FORKSERVER": "0"})])
def test_commands_that_need_a_fresh_interpreter_get_one(args, env, monkeypatch):
    if "FASTCKPT_TEST_FORKSERVER" in env:
        monkeypatch.setenv("FASTCKPT_TEST_FORKSERVER", "0")
    p = fastspawn.Popen([sys.executable, *args], env=_env(**env))
    assert p.wait(60) == 0
    assert not p.forked


def test_new_session_and_other_executables_are_plain_subprocesses():
    p = fastspawn.Popen([sys.executable, "-c", "pass"], env=_env(), start_new_session=True)
    assert p.wait(60) == 0 and not p.forked
    p = fastspawn.Popen(["true"])
    assert p.wait(60) == 0 and not p.forked


def test_a_dead_server_ends_the_wait_and_the_next_command_gets_a_new_one():
    """The server killed under a running child: waiting for that child does not hang (it reports 255, the
    status being lost with the server), and the next command starts through a new server."""
    p = fastspawn.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=_env())
    assert p.forked
    server = fastspawn._server.proc
    os.kill(server.pid, signal.SIGKILL)
    server.wait(30)
    try:
        assert p.wait(30) == 255
    finally:
        try:
            os.kill(p.pid, signal.SIGKILL)  # the orphaned child itself
        except ProcessLookupError:
            pass
    r = fastspawn.run([sys.executable, "-c", "print('again')"], env=_env(), capture_output=True, text=True,
                      timeout=60)
    assert (r.returncode, r.stdout) == (0, "again\n")
    assert fastspawn._server.proc is not server
