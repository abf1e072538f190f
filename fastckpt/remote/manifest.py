"""The remote tier's layout and its commit marker, the manifest.

A step lives under ``<url>/step_<N>/``: its files (one checkpoint file, or a
DCP directory's files under their relative paths) and, written LAST, since
object stores have no rename, ``step_<N>/fastckpt-manifest.json``:

.. code-block:: json

    {"format": "fastckpt-remote-manifest", "version": 1, "step": 100,
     "created": 1767225600.0, "kind": "file", "name": "step_100.pt",
     "files": [{"path": "step_100.pt", "size": 123, "crc32": 305419896}]}

``kind`` is "file" (one checkpoint file, restored as ``name``) or
"directory" (restored as the directory ``name``, its files under ``path``).
A step without a manifest is incomplete and is never restored; a step is
deleted manifest first, then its files, so that a deletion cut short leaves
an incomplete step, never a manifest naming missing files.
"""

import json
import time
from typing import Any, Dict, List, Optional

from .._core.steps import parse_step_name, step_name
from ..errors import FormatError
from ._policy import TransferOptions, retry
from .store import Store

__all__ = ["MANIFEST", "FORMAT", "VERSION", "step_prefix", "manifest_key", "make_manifest", "write_manifest",
           "read_manifest", "list_steps", "list_step_prefixes", "delete_step"]

MANIFEST = "fastckpt-manifest.json"
FORMAT = "fastckpt-remote-manifest"
VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists files; a bigger object is not one


def step_prefix(step: int) -> str:
    """The unpadded ``step_<N>`` prefix of a step's keys (what stored manifests use)."""
    return step_name(step, width=0)


def manifest_key(step: int) -> str:
    return f"{step_prefix(step)}/{MANIFEST}"


def make_manifest(step: int, kind: str, name: str, files: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The manifest of ``step``: ``files`` are {"path", "size", "crc32"}."""
    m = {"format": FORMAT, "version": VERSION, "step": int(step), "created": time.time(), "kind": kind,
         "name": name, "files": [{"path": f["path"], "size": int(f["size"]), "crc32": int(f["crc32"])}
                                 for f in sorted(files, key=lambda f: f["path"])]}
    _validate(m, "manifest")
    return m


def write_manifest(store: Store, manifest: Dict[str, Any], opts: Optional[TransferOptions] = None) -> None:
    """Write the manifest (the step's commit marker: call it after every file is uploaded)."""
    opts = (opts or TransferOptions()).resolved()
    key = manifest_key(manifest["step"])
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    retry(lambda: store.put(key, data), f"writing the manifest {store.key_url(key)}", store.key_url(key), opts)


def _bad(where: str, why: str) -> FormatError:
    return FormatError(f"{where}: not a valid fastckpt remote manifest: {why}")


def _safe_rel(p: Any) -> bool:
    return (isinstance(p, str) and p != "" and not p.startswith("/") and "\\" not in p and "\0" not in p
            and all(c not in ("", ".", "..") for c in p.split("/")))


def _validate(m: Any, where: str) -> Dict[str, Any]:
    if not isinstance(m, dict):
        raise _bad(where, f"a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT:
        raise _bad(where, f"format is {m.get('format')!r}, not {FORMAT!r}")
    if type(m.get("version")) is not int or m["version"] < 1:
        raise _bad(where, f"version {m.get('version')!r} is not a positive integer")
    if m["version"] > VERSION:
        raise _bad(where, f"version {m['version']} is newer than this fastckpt reads ({VERSION}): upgrade fastckpt")
    if type(m.get("step")) is not int or m["step"] < 0:
        raise _bad(where, f"step {m.get('step')!r} is not a non-negative integer")
    if not isinstance(m.get("created"), (int, float)):
        raise _bad(where, "created is not a number")
    if m.get("kind") not in ("file", "directory"):
        raise _bad(where, f"kind {m.get('kind')!r} is not 'file' or 'directory'")
    if not _safe_rel(m.get("name")) or "/" in m["name"]:
        raise _bad(where, f"name {m.get('name')!r} is not a plain file or directory name")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise _bad(where, "files is not a non-empty list")
    seen = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise _bad(where, f"files[{i}] is not an object")
        if not _safe_rel(f.get("path")):
            raise _bad(where, f"files[{i}].path {f.get('path')!r} is not a safe relative path")
        if f["path"] in seen or f["path"] == MANIFEST:
            raise _bad(where, f"files[{i}].path {f['path']!r} is listed twice or is the manifest")
        seen.add(f["path"])
        if type(f.get("size")) is not int or f["size"] < 0:
            raise _bad(where, f"files[{i}].size {f.get('size')!r} is not a non-negative integer")
        if type(f.get("crc32")) is not int or not 0 <= f["crc32"] < 1 << 32:
            raise _bad(where, f"files[{i}].crc32 {f.get('crc32')!r} is not a 32-bit unsigned integer")
    if m["kind"] == "file" and (len(files) != 1 or files[0]["path"] != m["name"]):
        raise _bad(where, "a 'file' step lists exactly one file, named as the step's name")
    return m


def parse_manifest(data: bytes, where: str, step: Optional[int] = None) -> Dict[str, Any]:
    """Parse and validate a manifest's bytes (FormatError naming ``where``)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(where, f"{len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        m = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(where, f"not JSON ({e})") from None
    _validate(m, where)
    if step is not None and m["step"] != step:
        raise _bad(where, f"it says step {m['step']}, under the prefix of step {step}")
    return m


def read_manifest(store: Store, step: int, opts: Optional[TransferOptions] = None) -> Dict[str, Any]:
    """The validated manifest of ``step``. Raises FileNotFoundError (no
    manifest: the step is incomplete), FormatError (malformed, too big, or of
    another step) naming its URL, OSError (the store, after the retries)."""
    opts = (opts or TransferOptions()).resolved()
    key = manifest_key(step)
    url = store.key_url(key)
    try:
        size = retry(lambda: store.size(key), f"reading {url}", url, opts)
    except FileNotFoundError:
        raise
    except OSError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise FileNotFoundError(2, f"{url} does not exist: step {step} is incomplete", url) from None
        raise
    if size > MAX_MANIFEST_BYTES:
        raise _bad(url, f"{size} bytes, more than {MAX_MANIFEST_BYTES}")
    data = retry(lambda: store.get_range(key, 0, size), f"reading {url}", url, opts)
    return parse_manifest(data, url, step)


def list_step_prefixes(store: Store, opts: Optional[TransferOptions] = None) -> Dict[int, Dict[str, int]]:
    """Every step prefix in the store, complete or not: step -> {relative key: size}."""
    opts = (opts or TransferOptions()).resolved()
    objs = retry(lambda: store.list(""), f"listing {store.url}", store.url, opts)
    out: Dict[int, Dict[str, int]] = {}
    for k, size in objs.items():
        head, _, rest = k.partition("/")
        step = parse_step_name(head)
        if step is not None and rest:
            out.setdefault(step, {})[rest] = size
    return out


def list_steps(store: Store, opts: Optional[TransferOptions] = None) -> List[int]:
    """The steps that have a manifest (complete, unless damaged), oldest first."""
    return sorted(s for s, files in list_step_prefixes(store, opts).items() if MANIFEST in files)


def delete_step(store: Store, step: int, opts: Optional[TransferOptions] = None,
                files: Optional[Dict[str, int]] = None) -> None:
    """Delete ``step``: its manifest first (the step stops being complete),
    then its files."""
    opts = (opts or TransferOptions()).resolved()
    pre = step_prefix(step)
    if files is None:
        files = retry(lambda: store.list(pre), f"listing {store.key_url(pre)}", store.url, opts)
        files = {k[len(pre) + 1:]: v for k, v in files.items()}
    retry(lambda: store.delete([manifest_key(step)]), f"deleting {store.key_url(manifest_key(step))}",
          store.url, opts)
    rest = [f"{pre}/{k}" for k in files if k != MANIFEST]
    if rest:
        retry(lambda: store.delete(rest), f"deleting step {step} under {store.url}", store.url, opts)
