"""Python child processes for the tests without a fresh ``import torch`` each.

Most of the suite's CPU went to starting Python processes: a rank, a killed
writer, a probe, each imports torch first (about 1.5 CPU-seconds here, on a
2-core machine that runs the tests on both). :class:`Popen` is
``subprocess.Popen`` for ``[sys.executable, ...]`` commands whose child is
instead forked from a server process (one per test process) that imported
torch once. The child then behaves as a fresh interpreter would for the
tests' purposes: its own argv, environment, working directory, sys.path (the
script's directory, then PYTHONPATH), standard streams (the fds the caller
gave, as subprocess passes them), ``__main__`` module, default signal
handlers, non-daemon threads joined and atexit handlers run at the end, its
exit status (a signal as a negative return code) reported by the server, which
is its parent. ``poll``/``wait``/``communicate``/``kill``/``send_signal`` work
as usual; the pid is the real process's.

What a forked child shares with the server and a fresh process would not: the
modules the server imported (torch, torch.distributed, numpy; not fastckpt),
their import-time state (torch's default RNG seed is a constant anyway;
Python's ``random`` is reseeded at fork), the string-hash seed, the parent pid
(the server's), and torch's intra-op thread count: the server starts with
OMP_NUM_THREADS=1 (no thread exists at fork), a child whose environment asks
for more gets ``torch.set_num_threads(n)``, one without OMP_NUM_THREADS keeps 1
(a fresh process would take the CPU count; no test depends on it). Commands
that need a fresh interpreter fall back to ``subprocess.Popen``: other
executables, interpreter options other than ``-u``/``-B``, an environment whose
LD_*, glibc's MALLOC_* and GLIBC_TUNABLES, PYTHONHASHSEED, PYTHONHOME,
PYTHONMALLOC, ... (see _startup_env) differ from the server's, ``preexec_fn``, ``pass_fds``,
``start_new_session``, user or group changes, and every command when
FASTCKPT_TEST_FORKSERVER=0. The tests about process start-up, exit and fork
(test_manager_exit, test_integrations_import, test_engine's fork tests, ...)
keep ``subprocess``.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

_PRELOAD = ("torch", "torch.distributed", "numpy")
# Environment variables that act when the interpreter or its libraries start: a child that sets them
# differently from the server needs a fresh process.
# (Besides these, every LD_*, MALLOC_* and GLIBC_* variable: the loader's and glibc's malloc tunables.)
_STARTUP_ENV = ("PYTHONHASHSEED", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONMALLOC", "PYTHONDEVMODE",
                "PYTHONWARNINGS", "PYTHONOPTIMIZE")
_MAX_MSG = 4 << 20


def _startup_env(env) -> set:
    """The variables of ``env`` that act at start-up."""
    return {k for k in env if k in _STARTUP_ENV or k.startswith(("MALLOC_", "GLIBC_", "LD_"))}


def _pythonpath() -> list:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _plan(args):
    """(kind, target, rest, unbuffered) when ``args`` can run in a forked child, else None."""
    args = [os.fspath(a) for a in args]
    if not args or args[0] != sys.executable:
        return None
    i, unbuffered = 1, False
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-c", "-m", "-"):
        flags = args[i][1:]
        if not flags or any(f not in "uB" for f in flags):
            return None
        unbuffered |= "u" in flags
        i += 1
    if i >= len(args) or args[i] == "-":
        return None
    if args[i] in ("-c", "-m"):
        if i + 1 >= len(args):
            return None
        return args[i], args[i + 1], args[i + 2:], unbuffered
    return "script", args[i], args[i + 1:], unbuffered


# ------------------------------------------------------------------------------------------ the server


def _recv_all(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _child(request, fds, close):
    """In the forked child: become the requested interpreter, run it, and end the process as the interpreter
    ends (SystemExit unwinds the server's loop: non-daemon threads joined, atexit handlers, C++ destructors)."""
    try:
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for c in close:
            fd = c.detach() if isinstance(c, socket.socket) else c
            try:
                os.close(fd)
            except OSError:
                pass
        for i, fd in enumerate(fds):
            if fd != i:
                os.dup2(fd, i)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if request["cwd"]:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        kind, target, rest = request["kind"], request["target"], request["rest"]
        unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
        import io
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered,
                                      line_buffering=os.isatty(1) and not unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                      line_buffering=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        first = os.path.dirname(os.path.abspath(target)) if kind == "script" else (os.getcwd() if kind == "-m" else "")
        sys.path[:] = [first] + _pythonpath() + request["base_path"]
        sys.dont_write_bytecode = request["dont_write_bytecode"] or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 1 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # the server's torch started with 1
        if kind == "script":
            with open(target, "rb") as f:
                source = f.read()
    except BaseException:
        try:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(1)
    try:
        if kind == "-m":
            import runpy
            sys.argv = [target] + rest  # runpy replaces argv[0] with the module's file
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            import types
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            if kind == "script":
                main.__file__ = target
                sys.argv = [target] + rest
            else:
                source, target = target, "<string>"
                sys.argv = ["-c"] + rest
            sys.modules["__main__"] = main
            exec(compile(source, target, "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    raise SystemExit(code)


def serve(listen_fd: int) -> None:
    """The server's loop (``python fastspawn.py --serve FD``): import torch, then fork a child for each request
    on the listening socket and send its wait status on the request's connection when it exits. Ends, killing
    the children still running, when its standard input (a pipe from the test process) closes."""
    for m in _PRELOAD:
        try:
            __import__(m)
        except ImportError:
            pass
    extra = _pythonpath()
    base_path = [p for p in sys.path[1:] if p not in extra]  # without this file's directory and PYTHONPATH
    listener = socket.socket(fileno=listen_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C of the test run reaches the tests, which end us
    import select
    conns = {}  # pid -> connection awaiting its exit status
    while True:
        ready, _, _ = select.select([listener, wake_r, 0], [], [])
        if 0 in ready and not os.read(0, 4096):
            break
        if wake_r in ready:
            os.read(wake_r, 4096)
        while conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("<i", status))
                except OSError:
                    pass
                conn.close()
        if listener in ready:
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 3)
                request = json.loads(msg)
            except (OSError, ValueError, EOFError):
                conn.close()
                continue
            if len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            request["base_path"] = base_path
            request["dont_write_bytecode"] = sys.dont_write_bytecode
            close = [listener, wake_r, wake_w, conn] + list(conns.values())
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(struct.pack("<q", -e.errno))
                except OSError:
                    pass
                conn.close()
                continue
            if pid == 0:
                _child(request, fds, close)
            for fd in fds:
                os.close(fd)
            conns[pid] = conn
            try:
                conn.sendall(struct.pack("<q", pid))
            except OSError:
                pass
    for pid in list(conns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(conns):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


# ------------------------------------------------------------------------------------------ the client

class _Server:
    """This process's server: started at the first request (and again after fork, or if it died)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        self.address = None
        self.pid = None  # the process that started it
        self.broken = False
        self.atexit_registered = False

    def address_for_request(self):
        with self.lock:
            if self.broken:
                return None
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                try:
                    self._start()
                except OSError:
                    self.broken = True  # no server to be had: every command starts as usual
                    return None
            return self.address

    def _start(self):
        import tempfile
        d = tempfile.mkdtemp(prefix="fastspawn-")
        address = os.path.join(d, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        listener.listen(64)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                                          str(listener.fileno())], stdin=subprocess.PIPE,
                                         pass_fds=[listener.fileno()], env=env)
        finally:
            listener.close()
        self.address, self.pid = address, os.getpid()
        self.env = env
        if not self.atexit_registered:
            import atexit
            atexit.register(self.stop)
            self.atexit_registered = True

    def stop(self):
        """End this process's server (closing its stdin ends it; its children still running are killed)."""
        proc = self.proc
        if proc is None or self.pid != os.getpid():
            return
        self.proc = None
        try:
            proc.stdin.close()
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        import shutil
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)


_server = _Server()


def _enabled() -> bool:
    return os.environ.get("FASTCKPT_TEST_FORKSERVER", "1") != "0" and hasattr(socket, "send_fds")


class Popen(subprocess.Popen):
    """``subprocess.Popen``; a ``[sys.executable, ...]`` child is forked from the torch-importing server
    where it can be (see the module's text), else started as usual. ``forked`` says which."""

    forked = False

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group=None):
        plan = None
        child_env = dict(os.environ if env is None else env)
        if (_enabled() and not shell and executable is None and preexec_fn is None and not pass_fds
                and not start_new_session and process_group in (None, -1) and gid is None and gids is None
                and uid is None and umask < 0 and not isinstance(args, (str, bytes, os.PathLike))):
            plan = _plan(args)
        address = None
        if plan is not None:
            address = _server.address_for_request()
            if address is not None and any(child_env.get(k) != _server.env.get(k)
                                           for k in _startup_env(child_env) | _startup_env(_server.env)):
                address = None
        if address is None:
            kw = dict(process_group=process_group) if sys.version_info >= (3, 11) else {}
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session, **kw)
        kind, target, rest, unbuffered = plan
        # -1: inherited from this process, as subprocess does (stderr=STDOUT arrives as errwrite == c2pwrite)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        request = {"kind": kind, "target": target, "rest": rest, "unbuffered": unbuffered,
                   "cwd": os.fspath(cwd) if cwd is not None else None,
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in child_env.items()}}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(address)
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            pid = struct.unpack("<q", _recv_all(conn, 8))[0]
        except BaseException:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if pid < 0:
            conn.close()
            raise OSError(-pid, os.strerror(-pid))
        self._status_conn = conn
        self.pid = pid
        self._child_created = True
        self.forked = True

    def _status(self, block: bool):
        conn = self._status_conn
        conn.setblocking(block)
        try:
            data = conn.recv(4)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        conn.close()
        if len(data) != 4:  # the server died with the child unreaped: nothing to tell
            return 255 << 8
        return struct.unpack("<i", data)[0]

    def _try_wait(self, wait_flags):
        if not self.forked:
            return super()._try_wait(wait_flags)
        if self._status_conn.fileno() < 0:
            return self.pid, 0
        sts = self._status(block=not (wait_flags & os.WNOHANG))
        return (0, 0) if sts is None else (self.pid, sts)

    def _internal_poll(self, _deadstate=None, **kw):
        if not self.forked:
            return super()._internal_poll(_deadstate=_deadstate, **kw)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """``subprocess.run`` with :class:`Popen`."""
    if capture_output:
        kwargs["stdout"] = subprocess.PIPE
        kwargs["stderr"] = subprocess.PIPE
    with Popen(*popenargs, stdin=subprocess.PIPE if input is not None else kwargs.pop("stdin", None),
               **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    serve(int(sys.argv[2]))
