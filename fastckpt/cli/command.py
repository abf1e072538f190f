"""The ``fastckpt`` command (also ``python -m fastckpt``): inspect, verify, convert, doctor, clean-memory, bench.

Results go to stdout; logging, progress bars and errors to stderr. Exit status:
0 success, 1 the operation failed (a damaged checkpoint, a refused
conversion, an I/O error), 2 a usage error (bad arguments, a path that does
not exist), 130 interrupted. See docs/CLI.md.
"""

import argparse
import contextlib
import json
import logging
import os
import pickle
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

log = logging.getLogger("fastckpt")


class UsageError(Exception):
    """Bad arguments or paths (exit 2)."""


class Failed(Exception):
    """The operation failed; the message says why (exit 1)."""


# ---------------------------------------------------------------- progress

class _Bar:
    """A tqdm progress bar in bytes, or nothing when stderr is not a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, total: int, desc: str) -> Optional[Callable[[Optional[int]], None]]:
        if not self.enabled or total <= 0:
            return None
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   dynamic_ncols=True, leave=False)

        def update(n: Optional[int]) -> None:
            if n is None:
                bar.close()
            else:
                bar.update(n)
        return update


def _progress_enabled(args) -> bool:
    if args.progress == "always":
        return True
    if args.progress == "never" or args.quiet:
        return False
    return sys.stderr.isatty()


# ---------------------------------------------------------------- commands

def _return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the system at once. Its default
    threshold rises after the first large free, after which freed tensors stay in
    the heap: a conversion that allocates one tensor after another would then
    hold more memory than it uses."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: allocations >= 1 MiB are mmap'd, unmapped when freed
    except (OSError, AttributeError):
        pass


def _blocked_at(path: str) -> str:
    """The directory on the way to `path` that this user may not look into (or `path`)."""
    cur = os.path.abspath(path)
    chain = []
    while True:
        chain.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for p in reversed(chain[:-1]):  # from the top down
        try:
            os.stat(p)
        except PermissionError:
            return os.path.dirname(p)
        except OSError:
            break
    return path


def _existing(path: str, what: str = "file or directory") -> str:
    """`path`, which must exist: a missing path is a usage error (exit 2); a
    permission problem is reported as one (exit 1), never as a missing path."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"{path}: no such {what}") from None
    except PermissionError as e:
        where = _blocked_at(path)
        why = (f"this user may not look into directory {where}" if where != path
               else "this user may not read it")
        raise PermissionError(e.errno, f"{path}: permission denied ({why})", path) from None
    return path


# ---------------------------------------------------------------- URLs (fastckpt.remote)

def _is_url(s: Any) -> bool:
    from .._core.paths import is_url
    return is_url(s)


def _storage_options(args) -> Optional[dict]:
    raw = getattr(args, "storage_options", None)
    if raw is None:
        return None
    try:
        opts = json.loads(raw)
    except ValueError as e:
        raise UsageError(f"--storage-options is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise UsageError("--storage-options is a JSON object ({\"key\": ..., ...})")
    return opts


def _with_urls(func):
    """Run a command whose PATH / SRC (a checkpoint to read) or DST (a file to
    write) may be URLs: a source is downloaded (parallel ranged reads) into a
    temporary directory first, a destination is written there and uploaded
    after; what the command prints names the URLs, not the temporary paths."""
    def run(args) -> int:
        import io
        import tempfile
        names = [n for n in ("path", "src", "dst") if _is_url(getattr(args, n, None))]
        if not names:
            return func(args)
        from ..errors import FormatError
        from ..remote import urlio
        opts = _storage_options(args)
        with tempfile.TemporaryDirectory(prefix="fastckpt-cli-") as tmp:
            subst, upload_to = {}, None
            for n in names:
                url = getattr(args, n)
                if n == "dst":
                    if getattr(args, "to", None) == "dcp" or url.endswith("/"):
                        raise UsageError(f"{url}: a DCP directory cannot be converted to a URL (a file can)")
                    if urlio.exists(url, opts) and not args.force:
                        raise UsageError(f"{url} exists; pass --force to replace it")
                    local = os.path.join(tmp, "out", url.rsplit("/", 1)[-1])
                    os.makedirs(os.path.dirname(local))
                    upload_to = (local, url)
                else:
                    local = urlio.fetch(url, opts, os.path.join(tmp, "in"))
                setattr(args, n, local)
                subst[local] = url
            def named(text: str) -> str:
                for local, url in subst.items():
                    text = text.replace(local, url)
                return text

            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    rc = func(args)
            except FormatError as e:
                raise FormatError(named(str(e))) from e
            finally:
                sys.stdout.write(named(out.getvalue()))
            if upload_to is not None and rc == EXIT_OK:
                urlio.put(upload_to[0], upload_to[1], opts)
            return rc
    return run


def cmd_inspect(args) -> int:
    from .inspect import inspect_data, inspect_text
    from ..sources.kinds import open_source
    _existing(args.path)
    if os.path.isdir(args.path) and not os.path.exists(os.path.join(args.path, ".metadata")):
        from .inspect import is_manager_dir
        if is_manager_dir(args.path):
            return _inspect_manager(args)
    with open_source(args.path) as src:
        report = inspect_data(src)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(inspect_text(report))
    return EXIT_OK


def _inspect_manager(args) -> int:
    from .._core.steps import split_step_name
    names = sorted(os.listdir(args.path))
    latest = None
    try:
        with open(os.path.join(args.path, "latest")) as f:
            latest = f.read().strip()
    except OSError:
        pass
    steps = [n for n in names if split_step_name(n) is not None]
    if args.json:
        print(json.dumps({"path": args.path, "format": "manager", "latest": latest, "checkpoints": steps}, indent=1))
    else:
        print(f"{args.path}: CheckpointManager directory, {len(steps)} checkpoint(s); latest -> {latest or '(none)'}")
        for n in steps:
            print(f"  {n}{'  <- latest' if n == latest else ''}")
        print(f"(inspect one with: fastckpt inspect {os.path.join(args.path, latest or (steps[-1] if steps else ''))})")
    return EXIT_OK


def cmd_verify(args) -> int:
    from .inspect import count_problems, has_unverified, verify, verify_text
    _existing(args.path)
    _return_freed_memory()
    rep = verify(args.path, _Bar(_progress_enabled(args)))
    failed = count_problems(rep) > 0 or (args.strict and has_unverified(rep))
    if args.json:
        out = rep.as_dict()
        out["ok"] = not failed
        print(json.dumps(out, indent=1, default=str))
    else:
        print(verify_text(rep, strict=args.strict))
    return EXIT_FAILED if failed else EXIT_OK


def cmd_convert(args) -> int:
    from . import convert as _convert
    from .._core.units import human
    from ..sources.kinds import is_dcp_dir, open_source
    src_path, dst = args.src, args.dst
    _existing(src_path)
    to = args.to or _convert.infer_target(dst)
    if to is None:
        raise UsageError(f"cannot tell the target format from {dst!r}: pass --to {{{','.join(_convert.TARGETS)}}}")
    if os.path.abspath(src_path) == os.path.abspath(dst):
        raise UsageError("the source and the destination are the same path")
    from .._core.dircommit import recover
    recover(dst)  # a directory that an interrupted replacement left aside is put back first
    if os.path.lexists(dst):
        if not args.force:
            raise UsageError(f"{dst} exists; pass --force to replace it")
        if to == "dcp" and not os.path.isdir(dst):
            raise UsageError(f"{dst} exists and is not a directory; a DCP checkpoint is a directory")
        if to == "dcp" and os.listdir(dst) and not is_dcp_dir(dst):
            raise UsageError(f"{dst} is a directory that holds something else than a DCP checkpoint; "
                             "--force replaces only a DCP checkpoint or an empty directory")
        if to != "dcp" and os.path.isdir(dst):
            raise UsageError(f"{dst} is a directory; a {to} checkpoint is a single file")
    parent = os.path.dirname(os.path.abspath(dst))
    _existing(parent, "directory")
    if not os.path.isdir(parent):
        raise UsageError(f"{parent}: not a directory")
    from .convert_ranks import convert_ranks, under_torchrun
    if under_torchrun():  # every rank of the job converts its share of a DCP directory into the one file
        if to == "dcp":
            raise UsageError("under torchrun, convert writes one file (safetensors, torch or fastckpt), not a "
                             "DCP directory")
        _return_freed_memory()
        with open_source(src_path, verify=args.verify) as src:
            stats = convert_ranks(src, dst, to, drop_non_tensors=args.drop_non_tensors)
            kind = src.kind
        print(f"{src_path} ({kind}) -> {dst} ({to}), rank {stats['rank']} of {stats['world']}: "
              f"{human(stats['bytes'])} of {human(stats['total'])} of tensor data ({stats['tensors']} tensors)")
        return EXIT_OK
    bar_factory = _Bar(_progress_enabled(args))
    _return_freed_memory()
    with _convert.engine_for_streaming(), open_source(src_path, verify=args.verify) as src:
        total = _convert.total_bytes(src, to)
        bar = bar_factory(total, f"{src.kind} -> {to}")
        try:
            stats = _convert.convert(src, dst, to, drop_non_tensors=args.drop_non_tensors, progress=bar)
        finally:
            if bar:
                bar(None)
        kind = src.kind
    print(f"{src_path} ({kind}) -> {dst} ({to}): {human(stats.get('bytes'))} of tensor data")
    return EXIT_OK


def cmd_doctor(args) -> int:
    from .doctor import diagnose, doctor_text
    d = args.dir
    if not os.path.isdir(d):
        raise UsageError(f"{d}: no such directory" if not os.path.exists(d) else f"{d}: not a directory")
    rep = diagnose(d)
    print(json.dumps(rep, indent=1, default=str) if args.json else doctor_text(rep))
    return EXIT_OK


def cmd_clean_memory(args) -> int:
    from ..memory.tier import memory_root
    from .memory import clean_memory, clean_memory_text
    root = memory_root(args.dir)
    if args.older_than is not None and args.older_than < 0:
        raise UsageError(f"--older-than must be >= 0 seconds (got {args.older_than:g})")
    if os.path.lexists(root) or args.dir is not None:  # a default that was never made: nothing to clean
        _existing(root, "directory")
        if not os.path.isdir(root):
            raise UsageError(f"{root}: not a directory")
    rep = clean_memory(root, older_than=args.older_than, dry_run=args.dry_run, force=args.force)
    print(json.dumps(rep, indent=1) if args.json else clean_memory_text(rep))
    return EXIT_OK


def _source_root() -> str:
    """The directory above the fastckpt package: a source checkout's root when fastckpt runs from one."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_module():
    """``benchmarks/bench_quick.py`` of the source checkout this package runs from, or None where there
    is none (an installed package: the benchmark harness is not part of it)."""
    import importlib
    import importlib.util
    bench_dir = os.path.join(_source_root(), "benchmarks")
    if not os.path.isfile(os.path.join(bench_dir, "bench_quick.py")):
        return None
    pkg = sys.modules.get("benchmarks")
    if pkg is None:  # the checkout's benchmarks/, whatever else sys.path holds
        spec = importlib.util.spec_from_file_location("benchmarks", os.path.join(bench_dir, "__init__.py"),
                                                      submodule_search_locations=[bench_dir])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = pkg
        try:
            spec.loader.exec_module(pkg)
        except BaseException:
            del sys.modules["benchmarks"]
            raise
    elif os.path.realpath(bench_dir) not in [os.path.realpath(p) for p in getattr(pkg, "__path__", [])]:
        raise ImportError(f"another module named 'benchmarks' is already imported ({pkg!r}), not {bench_dir}")
    return importlib.import_module("benchmarks.bench_quick")


def cmd_bench(args) -> int:
    mod = getattr(args, "_bench_module", None)
    if mod is None:
        raise Failed("fastckpt bench runs the benchmark harness of a source checkout (benchmarks/bench_quick.py), "
                     f"and this installation has none beside its package ({os.path.join(_source_root(), 'fastckpt')}"
                     "): in a checkout of the fastckpt repository, run `python -m fastckpt bench DIR` or "
                     "`python benchmarks/bench_quick.py DIR` (with `make build` done there first)")
    return int(mod.run(args) or 0)


# ---------------------------------------------------------------- parser

def _add_common(p: argparse.ArgumentParser, top: bool) -> None:
    # Subcommands accept the options too (fastckpt inspect -v x); SUPPRESS keeps their
    # defaults from overwriting what was given before the subcommand.
    default = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="count", help="more logging (-v: info, -vv: debug); errors show "
                   "their traceback", **({"default": 0} if top else default))
    p.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr; no progress bar",
                   **({"default": False} if top else default))


def _version_line() -> str:
    import torch
    from .. import __version__
    return f"fastckpt {__version__} (torch {torch.__version__})"


def build_parser(bench_module: Any = None) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, top=False)
    progress = argparse.ArgumentParser(add_help=False)  # the commands that read whole checkpoints
    progress.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                          help="progress bar on stderr (auto: when stderr is a terminal)")
    parser = argparse.ArgumentParser(
        prog="fastckpt",
        description="Inspect, verify and convert PyTorch checkpoints (fastckpt, torch.save, safetensors, DCP), "
                    "and check what this machine supports.",
        epilog="Exit status: 0 success, 1 failure (damaged checkpoint, refused conversion, I/O error), "
               "2 usage error. See docs/CLI.md.")
    _add_common(parser, top=True)
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds (reads no tensor data)",
                       description="Show the keys of a checkpoint file or DCP directory with dtype, shape, size "
                                   "and device, and totals. Runs no code from the checkpoint and reads no "
                                   "tensor data.")
    p.add_argument("path", help="checkpoint file (fastckpt, torch.save, safetensors) or DCP directory; or a URL "
                                "(s3://..., gs://..., file://...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec options of a URL argument (s3://...: credentials, endpoint), a JSON object")
    p.set_defaults(func=_with_urls(cmd_inspect))

    p = sub.add_parser("verify", parents=[common, progress], help="check every checksum and the structure",
                       description="Read the whole checkpoint and check every CRC-32 and the structure. Exit "
                                   "status 0 only if it is complete and intact. A CheckpointManager directory: "
                                   "its latest pointer and every checkpoint in it.")
    p.add_argument("path", help="checkpoint file, DCP directory or CheckpointManager directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--strict", action="store_true",
                   help="fail when data has no checksum to check it against (safetensors, legacy torch "
                        "files, torch.save with CRCs disabled)")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec options of a URL argument (s3://...: credentials, endpoint), a JSON object")
    p.set_defaults(func=_with_urls(cmd_verify))

    p = sub.add_parser("convert", parents=[common, progress], help="convert between fastckpt/torch, safetensors and DCP",
                       description="Convert a checkpoint, streaming: memory stays bounded by a few buffers (or "
                                   "the largest tensor for DCP), not by the checkpoint's size. Every file is "
                                   "written through the engine: temporary name, fdatasync, rename. Under "
                                   "torchrun (WORLD_SIZE > 1), every rank converts a share of a DCP directory "
                                   "into the one file (safetensors, torch or fastckpt): `torchrun "
                                   "--nproc_per_node N -m fastckpt convert DCP_DIR out.safetensors`.")
    p.add_argument("src", help="source checkpoint file or DCP directory")
    p.add_argument("dst", help="destination file or DCP directory")
    p.add_argument("--to", choices=["fastckpt", "torch", "safetensors", "dcp"],
                   help="target format (default: from DST's extension: .safetensors, .pt/.pth/.bin/.ckpt, "
                        "or an existing directory for dcp)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--drop-non-tensors", action="store_true",
                   help="--to safetensors: leave out non-tensor values instead of refusing")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check the source's CRC-32s while reading it (by default a corrupt source "
                        "stops the conversion instead of being copied into a valid-looking file)")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec options of a URL argument (s3://...: credentials, endpoint), a JSON object")
    p.set_defaults(func=_with_urls(cmd_convert))

    p = sub.add_parser("doctor", parents=[common], help="what this machine and directory support",
                       description="Probe io_uring, O_DIRECT, the filesystem, free space, CUDA and pinned memory, "
                                   "and show the effective knobs and what fastckpt will use in DIR.")
    p.add_argument("dir", nargs="?", default=".", help="directory checkpoints will go to (default: .)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("clean-memory", parents=[common],
                       help="remove the memory tier's snapshots of jobs that are gone",
                       description="Remove the namespaces of the memory tier's directory (MemoryTier snapshots "
                                   "in host memory) that no running process holds: owners of this host whose "
                                   "process is gone, and no owner at all. Only snapshot files, owner.json and "
                                   "their temporary files are removed; anything else is left and listed, and no "
                                   "symbolic link is followed.")
    p.add_argument("dir", nargs="?", default=None,
                   help="the memory directory (default: FASTCKPT_MEMORY_DIR, else /dev/shm/fastckpt)")
    p.add_argument("--older-than", type=float, metavar="SECONDS",
                   help="only namespaces not written to for at least SECONDS")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.add_argument("--force", action="store_true",
                   help="also remove namespaces whose owner is a process of another host (which cannot be asked "
                        "whether it runs)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_clean_memory)

    p = sub.add_parser("bench", parents=[common], help="measure save/load throughput in a directory",
                       description="Benchmark fastckpt in a directory (benchmarks/bench_quick.py of a source "
                                   "checkout; not part of an installed package).")
    if bench_module is not None:
        bench_module.add_arguments(p)
    else:
        p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench, _bench_module=bench_module)
    return parser


def _wants_bench(argv: Sequence[str]) -> bool:
    for a in argv:
        if not a.startswith("-"):
            return a == "bench"
    return False


# ---------------------------------------------------------------- main

@contextlib.contextmanager
def _logging(level: int):
    logger = logging.getLogger("fastckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fastckpt: %(levelname)s: %(message)s"))
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def _error(msg: str) -> None:
    print(f"fastckpt: error: {msg}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_module = None
    bench_error = None
    if _wants_bench(argv):
        try:
            bench_module = _bench_module()
        except Exception as e:  # noqa: BLE001 - reported as an error of the bench command
            bench_error = e
    parser = build_parser(bench_module)
    try:
        if _wants_bench(argv) and bench_module is None:
            # no harness to parse its options: whatever follows `bench` is left for the error that says so
            args, _ = parser.parse_known_args(argv)
        else:
            args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if not hasattr(args, "progress"):
        args.progress = "auto"
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    with _logging(level):
        try:
            if bench_error is not None:
                raise Failed(f"the bench command cannot be loaded: {type(bench_error).__name__}: {bench_error}")
            return args.func(args)
        except KeyboardInterrupt:
            _error("interrupted")
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            return EXIT_FAILED
        except UsageError as e:
            _error(str(e))
            return EXIT_USAGE
        except BaseException as e:  # noqa: BLE001 - every error becomes a message and an exit status
            if isinstance(e, SystemExit):
                raise
            if args.verbose:
                traceback.print_exc(file=sys.stderr)
            if isinstance(e, RecursionError):  # objects nested deeper than Python's recursion limit
                path = getattr(args, "path", None) or getattr(args, "src", None)
                _error(f"damaged or not a checkpoint: {path}: it nests objects too deeply to be handled ({e})")
            else:
                _error(_describe(e, args.verbose))
            return EXIT_FAILED


def _describe(e: BaseException, verbose: int) -> str:
    from ..errors import FormatError
    from .convert import ConvertError
    if isinstance(e, (Failed, ConvertError)):
        return str(e)
    if isinstance(e, FormatError):
        return f"damaged or not a checkpoint: {e}"
    if isinstance(e, pickle.UnpicklingError):
        return str(e)
    if isinstance(e, OSError):
        from .inspect import error_text
        return error_text(e)
    tail = "" if verbose else " (run with -v for the traceback)"
    return f"{type(e).__name__}: {e}{tail}"


if __name__ == "__main__":
    sys.exit(main())
