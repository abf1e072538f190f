"""The one restricted, size-guarded unpickler for every pickle fastckpt reads
outside torch's own ``weights_only`` path, and the one safety walk run before
torch's weights-only unpickler.

Pickles that fastckpt unpickles itself (DCP ``.metadata``, the ``data.pkl`` of
DCP tensor records on :class:`~fastckpt.dcp.FastReader`'s fast path, the
command's DCP sources) go through :func:`loads`, in two steps:

1. **A walk of the opcodes** (nothing is built, no global is imported) that
   follows the unpickler's stack and refuses, before anything is unpickled, a
   pickle that

   - calls (``REDUCE``, ``NEWOBJ``) anything but a global, fills (``BUILD``)
     anything but what a call made, or uses a persistent id the caller has no
     handler for, or an opcode that only other kinds of pickles use (``INST``,
     ``OBJ``, ``EXT*``, out-of-band buffers): :class:`Refused`, a
     ``pickle.UnpicklingError``;
   - would make CPython's unpickler allocate memory that the data cannot
     account for: a memo index beyond the entries stored so far (the C
     unpickler sizes its memo table from a ``PUT``'s index: 10 bytes could ask
     for 64 GiB, zero-filled), a counted size (``BINBYTES8``, ``BINUNICODE8``,
     ``FRAME``, ...) larger than the bytes that follow, containers nested
     deeper than :data:`MAX_DEPTH` (DCP metadata) or :data:`MAX_OBJECT_DEPTH`
     (the user's objects, :func:`check`) as they are built (hashing a deeply nested
     tuple overflows the C stack; lists and dicts nested later through the
     memo are not counted, Python's recursion guards cover them), or an
     estimate of what the unpickled objects take that
     exceeds :data:`MAX_RATIO` times the pickle's size (plus
     :data:`MIN_BUDGET`): :class:`fastckpt.FormatError`.

2. **CPython's C unpickler**, whose ``find_class`` returns only the objects of
   the allow-list (it never imports a module the file names; a global outside
   it is :class:`Refused` when the unpickler reaches it, as in torch's
   weights-only unpickler, after only allowed objects were made) and whose
   ``persistent_load`` is the caller's handler or a refusal.

A policy is a ``find_class(module, name)`` callable that returns the object
to use or raises; :func:`dcp_metadata_class` is the one for DCP metadata, and
``fastckpt.formats.dcp`` has the one for tensor records' ``data.pkl``.

:func:`check` is the walk alone, for pickles that torch's weights-only
unpickler then judges (torch.save's ``data.pkl``, DCP values): it bounds memory
and nesting only and leaves every class, callable and ``BUILD`` to torch's
rules (its allow-list, ``torch.serialization.add_safe_globals``, the
``safe_globals`` context), so it accepts calls of what a call returned (a
nested class or a classmethod reached through ``getattr``), which torch's
unpickler then allows or refuses by value.

The walk runs in C++ (``_C.pickle_check``, csrc/pickle/pickle_scan.cc, without
the GIL), about 100 times faster than the same walk in Python
(:func:`check_reference`, ``pickletools.genops``), which is kept only as the
test oracle: tests/python/formats/test_pickle_walk.py asserts that both give the same
verdicts and messages.
Every message names the caller's ``where`` (the user's path) and, for a
refusal, says that nothing from the file was run.
"""

import io
import pickle
import pickletools
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import FormatError

__all__ = ["loads", "check", "check_reference", "Refused", "dcp_metadata_class", "MAX_DEPTH", "MAX_OBJECT_DEPTH", "MAX_RATIO", "MIN_BUDGET"]

MAX_DEPTH = 100          # containers nested deeper are refused (DCP metadata nests about 10 deep)
# For the user's own objects (check(): torch.save's data.pkl, DCP values): pickle itself cannot write
# deeper than Python's recursion limit (1000 by default), and hashing a tuple 1000 deep is a few
# hundred KiB of C stack, far inside a thread's 8 MiB.
MAX_OBJECT_DEPTH = 1000
MAX_RATIO = 64           # the objects may take at most this many times the pickle's size ...
MIN_BUDGET = 1 << 20     # ... or this many bytes, whichever is more

NOTHING_RUN = "nothing from the file was run"


class Refused(pickle.UnpicklingError):
    """The pickle asks for something the policy does not allow (a global, a call,
    a persistent id); it was refused before anything was unpickled."""


# ---------------------------------------------------------------- the walk

class _Node:
    """What the walk knows of one object on the unpickler's stack: its kind, how
    many elements a copy of it would make (`count`) and how deeply it nests."""

    __slots__ = ("kind", "count", "depth")

    def __init__(self, kind: str, count: int = 0, depth: int = 0):
        self.kind = kind
        self.count = count
        self.depth = depth


_SCALAR = _Node("scalar")  # shared: scalars are never containers, never changed

# Estimated bytes each opcode makes the unpickler allocate (the object, its
# stack and memo slots; per element for containers and for what a call or a
# BUILD copies). On real DCP metadata the estimate is about 20 times the
# pickle's size, where tracemalloc measures about 13.
_C_SLOT, _C_NUM, _C_OBJ, _C_SET, _C_ELEM, _C_ENTRY = 8, 32, 64, 216, 8, 56

# Opcode -> handler number, the frequent ones (in DCP metadata) first.
(_MEMO, _GET, _SCAL, _MARK, _CALL, _BUILD, _SETS, _EDICT, _TUPN, _STR, _CNT, _TUPM, _ELIST, _ESET,
 _ADD, _POP, _POPM, _DUP, _PUT, _GLOB, _SGLOB, _PERS, _PROTO, _FRAME, _STOP, _REFUSE) = range(26)
_HANDLER = {
    "MEMOIZE": _MEMO, "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET,
    "NONE": _SCAL, "NEWTRUE": _SCAL, "NEWFALSE": _SCAL, "EMPTY_TUPLE": _SCAL, "INT": _SCAL, "BININT": _SCAL,
    "BININT1": _SCAL, "BININT2": _SCAL, "FLOAT": _SCAL, "BINFLOAT": _SCAL,
    "MARK": _MARK, "REDUCE": _CALL, "NEWOBJ": _CALL, "NEWOBJ_EX": _CALL, "BUILD": _BUILD,
    "SETITEM": _SETS, "SETITEMS": _SETS, "EMPTY_DICT": _EDICT, "TUPLE1": _TUPN, "TUPLE2": _TUPN,
    "TUPLE3": _TUPN, "UNICODE": _STR, "SHORT_BINUNICODE": _STR, "BINUNICODE": _STR, "BINUNICODE8": _STR,
    "LONG": _CNT, "LONG1": _CNT, "LONG4": _CNT, "BINBYTES": _CNT, "SHORT_BINBYTES": _CNT, "BINBYTES8": _CNT,
    "BYTEARRAY8": _CNT, "STRING": _CNT, "BINSTRING": _CNT, "SHORT_BINSTRING": _CNT,
    "LIST": _TUPM, "TUPLE": _TUPM, "DICT": _TUPM, "FROZENSET": _TUPM, "EMPTY_LIST": _ELIST,
    "EMPTY_SET": _ESET, "APPEND": _ADD, "APPENDS": _ADD, "ADDITEMS": _ADD, "POP": _POP, "POP_MARK": _POPM,
    "DUP": _DUP, "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "GLOBAL": _GLOB, "STACK_GLOBAL": _SGLOB,
    "PERSID": _PERS, "BINPERSID": _PERS, "PROTO": _PROTO, "FRAME": _FRAME, "STOP": _STOP,
}
_REFUSED_OPS = {"INST": "INST (protocol-0 instantiation)", "OBJ": "OBJ (protocol-1 instantiation)",
                "EXT1": "EXT1 (extension registry)", "EXT2": "EXT2 (extension registry)",
                "EXT4": "EXT4 (extension registry)", "NEXT_BUFFER": "NEXT_BUFFER (out-of-band buffer)",
                "READONLY_BUFFER": "READONLY_BUFFER (out-of-band buffer)"}
_BY_OPCODE = {op: _HANDLER.get(op.name, _REFUSE) for op in pickletools.opcodes}
_MARK_KIND = {"LIST": "list", "TUPLE": "tuple", "DICT": "dict", "FROZENSET": "frozenset"}


def _walk(data: bytes, where: str, find_class: Callable[[str, str], Any], persistent: bool,
          max_depth: int = MAX_DEPTH, call_objects: bool = False) -> int:
    """Check `data` (see the module's docstring); returns the estimated bytes its
    objects take. The Python walk: the reference of the C++ one, for tests only.
    With `call_objects`, a call may call what a call returned (:func:`check`)."""
    n = len(data)
    budget = max(MIN_BUDGET, MAX_RATIO * n)
    cost = 0
    stack: list = []
    marks: list = []
    memo: list = []
    fence = 0  # the unpickler never pops below the last MARK
    by_opcode = _BY_OPCODE

    def bad(msg: str, pos: int) -> FormatError:
        return FormatError(f"{where}: {msg} at byte {pos} of the {n}-byte pickle (damaged or crafted; refused "
                           f"before unpickling, {NOTHING_RUN})")

    def refused(msg: str, pos: int) -> Refused:
        return Refused(f"{where}: refused to unpickle: {msg} at byte {pos}; {NOTHING_RUN}")

    def pop_mark(pos: int) -> list:
        """The items above the last MARK, taken off the stack with the MARK."""
        nonlocal fence
        if not marks:
            raise bad("no MARK to pop to", pos)
        items = stack[fence:]
        del stack[fence:]
        marks.pop()
        fence = marks[-1] if marks else 0
        return items

    def pop(pos: int):
        if len(stack) <= fence:
            raise bad("stack underflow", pos)
        return stack.pop()

    def count_of(x) -> int:  # capped: a count above the budget is refused when it is used
        if type(x) is _Node:
            return x.count if x.count < budget else budget
        return len(x) if type(x) is str else 0

    def nest(node: _Node, items, pos: int) -> None:
        d = 1 + max((x.depth for x in items if type(x) is _Node), default=0)
        if d > node.depth:
            if d > max_depth:
                raise bad(f"containers nested more than {max_depth} deep", pos)
            node.depth = d

    def target(kinds: Tuple[str, ...], op: str, pos: int) -> _Node:
        if len(stack) <= fence:
            raise bad(f"{op} without an object to add to", pos)
        t = stack[-1]
        if not (type(t) is _Node and t.kind in kinds):
            raise refused(f"{op} on a {_kind(t)} (only {'/'.join(kinds)} allowed)", pos)
        return t

    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data)):
            h = by_opcode[op]
            if h == _MEMO or h == _PUT:
                idx = len(memo) if h == _MEMO else arg
                if len(stack) <= fence:
                    raise bad(f"{op.name} with an empty stack", pos)
                if idx == len(memo):
                    memo.append(stack[-1])
                    cost += 3 * _C_SLOT  # the C unpickler's memo table doubles as it grows
                elif type(idx) is int and 0 <= idx < len(memo):
                    memo[idx] = stack[-1]
                else:
                    raise bad(f"memo index {idx!r} skips ahead of the {len(memo)} entries stored so far", pos)
                continue
            if h == _GET:
                if type(arg) is not int or not 0 <= arg < len(memo):
                    raise bad(f"memo index {arg!r} was never stored", pos)
                stack.append(memo[arg])
                cost += _C_SLOT
                continue
            if h == _SCAL:
                stack.append(_SCALAR)
                cost += _C_NUM
                continue
            if h == _MARK:
                marks.append(len(stack))
                fence = len(stack)
                cost += _C_SLOT
            elif h == _CALL:
                kwargs = pop(pos) if op.name == "NEWOBJ_EX" else None
                args = pop(pos)
                func = pop(pos)
                if not (type(func) is _Node and (func.kind == "global" or (call_objects and func.kind == "inst"))):
                    raise refused(f"{op.name} calls a {_kind(func)}, not an allowed global", pos)
                node = _Node("inst", count_of(args) + count_of(kwargs),
                             max(args.depth if type(args) is _Node else 0,
                                 kwargs.depth if type(kwargs) is _Node else 0))
                stack.append(node)
                cost += _C_OBJ + _C_ENTRY * node.count
            elif h == _BUILD:
                state = pop(pos)
                t = target(("inst",), "BUILD", pos)
                nest(t, [state], pos)
                cost += _C_OBJ + _C_ENTRY * count_of(state)
            elif h == _SETS:
                if op.name == "SETITEM":
                    v = pop(pos)
                    items = [pop(pos), v]
                else:
                    items = pop_mark(pos)
                if len(items) % 2:
                    raise bad(f"odd number of items for {op.name}", pos)
                t = target(("dict", "inst"), op.name, pos)
                t.count += len(items) // 2
                cost += _C_ENTRY * (len(items) // 2)
                nest(t, items, pos)
            elif h == _EDICT:
                stack.append(_Node("dict", 0, 1))
                cost += _C_OBJ
            elif h == _TUPN:
                k = int(op.name[-1])
                if len(stack) - k < fence:
                    raise bad("stack underflow", pos)
                items = stack[len(stack) - k:]
                del stack[len(stack) - k:]
                node = _Node("tuple", k + sum(count_of(x) for x in items))
                nest(node, items, pos)
                stack.append(node)
                cost += _C_OBJ + k * _C_ELEM
            elif h == _STR:
                s = arg if type(arg) is str else ""
                stack.append(s)
                cost += _C_OBJ + 2 * len(s)
            elif h == _CNT:
                k = len(arg) if isinstance(arg, (bytes, str)) else (arg.bit_length() // 8 if type(arg) is int else 0)
                stack.append(_Node("bytes", k))
                cost += _C_OBJ + k
            elif h == _TUPM:
                items = pop_mark(pos)
                kind = _MARK_KIND[op.name]
                if kind == "dict" and len(items) % 2:
                    raise bad("odd number of items for DICT", pos)
                node = _Node(kind, len(items) + (sum(count_of(x) for x in items) if kind == "tuple" else 0))
                nest(node, items, pos)
                stack.append(node)
                cost += (_C_SET if kind == "frozenset" else _C_OBJ) + len(items) * (
                    _C_ELEM if kind in ("list", "tuple") else _C_ENTRY)
            elif h == _ELIST:
                stack.append(_Node("list", 0, 1))
                cost += _C_OBJ
            elif h == _ESET:
                stack.append(_Node("set", 0, 1))
                cost += _C_SET
            elif h == _ADD:
                if op.name == "APPEND":
                    items = [pop(pos)]
                else:
                    items = pop_mark(pos)
                if op.name == "ADDITEMS":
                    t = target(("set", "inst"), op.name, pos)
                    cost += _C_ENTRY * len(items)
                else:
                    t = target(("list",), op.name, pos)
                    cost += 2 * _C_ELEM * len(items)
                t.count += len(items)
                nest(t, items, pos)
            elif h == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                else:
                    pop(pos)
            elif h == _POPM:
                pop_mark(pos)
            elif h == _DUP:
                stack.append(pop(pos))
                stack.append(stack[-1])
                cost += _C_SLOT
            elif h == _GLOB or h == _SGLOB:
                if h == _GLOB:
                    module, qual = _global_arg(data, pos, bad)
                else:
                    qual, module = pop(pos), pop(pos)
                    if not (type(module) is str and type(qual) is str):
                        raise bad("STACK_GLOBAL needs a module and a name string", pos)
                try:
                    find_class(module, qual)  # raises if the policy refuses it
                except Refused as e:
                    raise Refused(f"{where}: refused to unpickle: {e}; {NOTHING_RUN}") from None
                stack.append(_Node("global"))
                cost += _C_OBJ
            elif h == _PERS:
                if not persistent:
                    raise refused("a persistent id (none are allowed here)", pos)
                pid = pop(pos) if op.name == "BINPERSID" else _SCALAR
                stack.append(_Node("inst", 1, pid.depth if type(pid) is _Node else 0))  # an opaque object
                cost += _C_OBJ + _C_ELEM * count_of(pid)  # the handlers (fastckpt's, torch's) copy nothing
            elif h == _PROTO:
                if not 0 <= arg <= pickle.HIGHEST_PROTOCOL:
                    raise bad(f"unsupported pickle protocol {arg}", pos)
            elif h == _FRAME:
                if arg > n - pos - 9:
                    raise bad(f"a frame of {arg} bytes in the {n - pos - 9} bytes that follow", pos)
            elif h == _STOP:
                if len(stack) != 1 or marks:
                    raise bad(f"STOP with {len(stack)} objects on the stack", pos)
            elif op.name in _REFUSED_OPS:
                raise refused(f"opcode {_REFUSED_OPS[op.name]} (not used by the pickles read here)", pos)
            else:  # an opcode this walk does not know (a newer protocol)
                raise refused(f"unknown opcode {op.name}", pos)
            if cost > budget:
                raise bad(f"the objects would take more than {budget} bytes ({MAX_RATIO} times the pickle's "
                          "size)", pos)
        if cost > budget:
            raise bad(f"the objects would take more than {budget} bytes ({MAX_RATIO} times the pickle's size)", n)
        return cost
    except (FormatError, pickle.UnpicklingError):
        raise
    except (ValueError, EOFError, OverflowError, UnicodeDecodeError) as e:  # genops: damaged opcodes / arguments
        raise FormatError(f"{where}: damaged pickle ({e}); refused before unpickling, {NOTHING_RUN}") from None


def _kind(x) -> str:
    if isinstance(x, _Node):
        return {"inst": "constructed object", "global": "global"}.get(x.kind, x.kind)
    return "string"


def _global_arg(data: bytes, pos: int, bad) -> Tuple[str, str]:
    """GLOBAL's two lines exactly as the C unpickler reads them (genops joins them with a space)."""
    a = data.find(b"\n", pos + 1)
    b = data.find(b"\n", a + 1) if a >= 0 else -1
    if b < 0:
        raise bad("GLOBAL without two lines", pos)
    try:
        return data[pos + 1:a].decode("utf-8"), data[a + 1:b].decode("utf-8")
    except UnicodeDecodeError:
        raise bad("GLOBAL names that are not UTF-8", pos) from None


# ---------------------------------------------------------------- unpickling

class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, find_class, persistent_load, where: str):
        super().__init__(io.BytesIO(data))
        self._find = find_class
        self._pl = persistent_load
        self._where = where

    def find_class(self, module, name):
        try:
            return self._find(module, name)
        except Refused as e:
            raise Refused(f"{self._where}: refused to unpickle: {e}; {NOTHING_RUN}") from None

    def persistent_load(self, pid):
        if self._pl is None:
            raise Refused(f"{self._where}: refused to unpickle: a persistent id (none are allowed here); {NOTHING_RUN}")
        return self._pl(pid)


def loads(data: bytes, where: str, find_class: Callable[[str, str], Any], *,
          persistent_load: Optional[Callable[[Any], Any]] = None,
          passthrough: Tuple[type, ...] = ()) -> Any:
    """Unpickle `data` with only what `find_class` allows, after a walk that
    refuses what would allocate more than the data accounts for.

    Args:
        data: the pickle.
        where: the user's name for it (a path), used in every message.
        find_class: ``(module, name) -> object``; raises (typically
            :class:`Refused`) for anything it does not allow. It must not import
            modules named by the file.
        persistent_load: handler of persistent ids; without one they are refused.
        passthrough: exception types of the caller (raised by its find_class,
            persistent_load or allowed callables) to let through unchanged.

    Raises:
        Refused (a ``pickle.UnpicklingError``): a global, call or persistent id
            the policy does not allow; nothing was run.
        fastckpt.FormatError: a damaged pickle, or one that would allocate far
            more than its size (huge memo indices, counted sizes past the end,
            deep nesting).
    """
    data = bytes(data)
    _c_walk(data, where, persistent_load is not None, MAX_DEPTH, call_objects=False)
    try:
        return _Unpickler(data, find_class, persistent_load, where).load()
    except passthrough:
        raise
    except (Refused, FormatError, MemoryError, RecursionError):
        raise
    except Exception as e:  # damage the walk cannot see (wrong argument types, a bad enum value, ...)
        raise FormatError(f"{where}: damaged pickle ({type(e).__name__}: {e})") from None


def _any_global(module: str, name: str) -> None:
    return None


def _c_walk(data: bytes, where: str, persistent: bool, max_depth: int, *, call_objects: bool,
            plain: Optional[list] = None) -> int:
    """The walk, in C++ (the one production runs); raises as :func:`_walk` does. `plain`, if
    given, receives the walk's verdict on the vocabulary (see :func:`check`)."""
    from .. import _C
    n = len(data)
    kind, msg, pos, cost, is_plain = _C.pickle_check(data, persistent, max_depth, MAX_RATIO, MIN_BUDGET,
                                                     _max_str_digits(), call_objects)
    if kind == 0:
        if plain is not None:
            plain.append(bool(is_plain))
        return cost
    if kind == 1:
        raise FormatError(f"{where}: {msg} at byte {pos} of the {n}-byte pickle (damaged or crafted; refused "
                          f"before unpickling, {NOTHING_RUN})")
    if kind == 2:
        raise Refused(f"{where}: refused to unpickle: {msg} at byte {pos}; {NOTHING_RUN}")
    raise FormatError(f"{where}: damaged pickle ({msg}); refused before unpickling, {NOTHING_RUN}")


def check(data: bytes, where: str, *, persistent: bool = True, max_depth: int = MAX_OBJECT_DEPTH,
          plain: Optional[list] = None) -> int:
    """Only the walk, for a pickle that torch's weights-only unpickler will
    judge class by class: it is not handed a pickle that would allocate far
    more than its size or nest deep enough to overflow the C stack when a key is
    hashed. Every global is accepted and nothing is imported; a call may call
    what a call returned (torch's unpickler allows or refuses each callable by
    its value, as ``getattr`` reaching a nested class or a classmethod needs).
    Returns the estimated bytes; raises FormatError or Refused (an opcode that
    torch.save never writes, a call of a container or a string). `plain`, if
    given (a list), gets whether the pickle keeps to the vocabulary of a
    torch.save'd state dict (``PickleVerdict::plain``, csrc/pickle/pickle_scan.h),
    which :mod:`fastckpt.torchsave.plain` unpickles with CPython's C unpickler."""
    return _c_walk(data, where, persistent, max_depth, call_objects=True, plain=plain)


def check_reference(data: bytes, where: str, *, persistent: bool = True, max_depth: int = MAX_OBJECT_DEPTH,
                    call_objects: bool = True) -> int:
    """The Python walk (pickletools.genops), for tests only: the oracle of the
    C++ walk. With the defaults, :func:`check`'s verdicts; with
    ``call_objects=False``, the walk of :func:`loads`."""
    return _walk(bytes(data), where, _any_global, persistent, max_depth, call_objects)


def _max_str_digits() -> int:
    """Python's limit on the digits of a decimal int (int() refuses longer arguments in the walk too)."""
    get = getattr(sys, "get_int_max_str_digits", None)
    return get() if get is not None else 0


# ---------------------------------------------------------------- the DCP metadata policy

# What stock DCP writes into .metadata, today and in older releases that this
# torch still reads: stock FileSystemReader unpickles .metadata with plain
# pickle.load (running whatever the file names); FastReader takes these
# classes, from modules fastckpt imports itself, and nothing else but what the
# user allowed (see dcp_metadata_class).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # older releases wrote TensorProperties (and its memory-format enum) from the sharded tensor's metadata
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
    "pathlib": ("PosixPath", "PurePosixPath", "Path"),
    "pathlib._local": ("PosixPath", "PurePosixPath", "Path"),  # how Python >= 3.13 pickles paths
    "builtins": ("set", "frozenset", "slice"),
}
_dcp_table: Optional[Dict[Tuple[str, str], Any]] = None


def _dcp_allowed() -> Dict[Tuple[str, str], Any]:
    """(module, name) -> object, built from fastckpt's own imports (never from a name in a file)."""
    global _dcp_table
    if _dcp_table is None:
        import builtins
        import collections
        import importlib
        import pathlib

        import torch
        import torch.distributed.checkpoint.filesystem  # noqa: F401
        import torch.distributed.checkpoint.metadata  # noqa: F401
        import torch.serialization  # noqa: F401
        mods = {"builtins": builtins, "collections": collections, "pathlib": pathlib, "torch": torch}
        table: Dict[Tuple[str, str], Any] = {}
        for mod, names in _DCP_CLASSES.items():
            m = mods.get(mod)
            if m is None:
                if mod == "pathlib._local":
                    m = getattr(pathlib, "_local", None)
                    if m is None:
                        continue
                else:
                    try:
                        m = importlib.import_module(mod)  # one of the fixed modules above
                    except ImportError:  # a torch without it
                        continue
            for name in names:
                if hasattr(m, name):
                    table[(mod, name)] = getattr(m, name)
        for name, v in vars(torch).items():
            if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
                table[("torch", name)] = v
        _dcp_table = table
    return _dcp_table


def _user_allowed(module: str, name: str) -> Any:
    """What the user allowed for `module`.`name` with torch.serialization.add_safe_globals or the
    safe_globals context, looked up by torch's own function and naming (``module.qualname``, or
    the name given with the object), or None; torch's blocked modules never."""
    try:
        from torch import _weights_only_unpickler as wo
        user = wo._get_user_allowed_globals()
        blocked = getattr(wo, "_blocklisted_modules", ())
    except Exception:  # a torch without them
        return None
    if module in blocked:
        return None
    return user.get(f"{module}.{name}")


def dcp_metadata_class(module: str, name: str) -> Any:
    """The policy for DCP ``.metadata``: the classes stock DCP writes there
    (torch.distributed.checkpoint's metadata classes, and the TensorProperties
    of older releases), dtypes, layouts, memory formats, torch.Size,
    OrderedDict, paths, sets and slices, and the *classes* the user allowed with
    ``torch.serialization.add_safe_globals`` or the ``safe_globals`` context
    (looked up as torch looks them up). A function the user allowed (such as
    ``getattr``) is refused here: torch's weights-only unpickler checks what
    each call returns before calling or filling it, CPython's unpickler does
    not, so here only constructors of allowed classes may be called. Anything
    else is :class:`Refused`."""
    obj = _dcp_allowed().get((module, name))
    if obj is not None:
        return obj
    obj = _user_allowed(module, name)
    if obj is not None:
        if isinstance(obj, type):
            return obj
        raise Refused(f"global {module}.{name} is allowed by torch.serialization.add_safe_globals but is not a "
                      "class: DCP metadata takes only classes from it (no function whose result is not checked)")
    raise Refused(f"global {module}.{name} is not a DCP metadata class (allowed: torch.distributed.checkpoint's "
                  "metadata classes, dtypes, torch.Size, paths; more classes with "
                  "torch.serialization.add_safe_globals)")
