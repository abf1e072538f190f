"""The source of a fastckpt or stock torch.save zip archive: :class:`ZipSource`."""

import pickle
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.serialization as ts

from .._core import engine as _engine
from ..formats import unpickler as _unpickle, zip as _zip
from ..formats.torch_rules import itemsize
from ..torchsave.plain import load_plain
from ..torchsave.reader import Reader, Records, parse_checkpoint
from ..errors import FormatError
from .source import CHUNK, STORAGE_ATTR, FileSource, Storage, aligned_buffer


class _MetaUnpickler(ts._weights_only_unpickler.Unpickler):
    """torch's weights-only unpickler; every storage it makes is tagged with its
    persistent id (torch._load assigns persistent_load after construction)."""

    on_storage: Callable = None  # type: ignore[assignment]

    @property
    def persistent_load(self):  # type: ignore[override]
        return self._pl

    @persistent_load.setter
    def persistent_load(self, f):
        def wrapped(pid):
            typed = f(pid)
            type(self).on_storage(pid, typed._untyped_storage)
            return typed
        self._pl = wrapped



class ZipSource(FileSource):
    """A fastckpt or torch.save zip archive. With `verify` (default), every storage
    read whole is checked against its CRC-32 as it is read."""

    def __init__(self, path: str, verify: bool = True):
        self.verify = verify
        super().__init__(path)

    def _parse(self) -> None:
        path, fd = self.path, self.f.fileno()
        self.archive = parse_checkpoint(path, self.f)
        recs = self.archive.records
        # the record reader of fastckpt.load: reads go to this open file, CRC-32s come with them
        self.records = Records(path, self.archive, fd, verify=False)
        small_names = [n for n in recs if not n.startswith("data/")]
        # metadata records are small: always checked; callers decide what a mismatch means
        self.bad_small: List[str] = []
        self.small = self.records.read(small_names, [], bad_small=self.bad_small)
        order = self.small.get("byteorder", b"little")
        if order not in (b"little", b"big"):
            raise FormatError(f"{path}: unknown byte order {order!r} in record 'byteorder'")
        self.byteorder = order.decode()
        try:
            self.alignment = int(self.small.get(".storage_alignment", b"64"))
        except ValueError:
            raise FormatError(f"{path}: record '.storage_alignment' holds {self.small['.storage_alignment']!r}") \
                from None
        self.storages: Dict[str, Storage] = {
            n: Storage(n, e.size, torch.uint8, crc=e.crc) for n, e in recs.items() if n.startswith("data/")}
        self.kind = "fastckpt" if _zip.is_fastckpt_layout(recs, self.alignment) else "torch"
        # storage records of at least DIRECT_MIN bytes start on this (fastckpt files)
        self.large_alignment = _zip.large_alignment(self.alignment) if self.kind == "fastckpt" else self.alignment
        self._tree = None
        self._used: Dict[str, Storage] = {}

    def description(self) -> str:
        n = len(self.storages)
        if self.kind != "fastckpt":
            what = f"torch.save checkpoint (zip archive, records aligned to {self.alignment} bytes)"
        elif self.large_alignment == self.alignment:
            what = f"fastckpt checkpoint (torch.save zip archive, records aligned to {self.alignment} bytes)"
        else:
            what = (f"fastckpt checkpoint (torch.save zip archive, storage records of {_zip.DIRECT_MIN >> 10} KiB "
                    f"or more aligned to {self.large_alignment} bytes, the others to {self.alignment})")
        return f"{what}, {n} storage record{'s' if n != 1 else ''}"

    def check_small(self) -> None:
        if self.bad_small:
            raise FormatError(f"{self.path}: checksum mismatch in record {self.bad_small[0]!r} (corrupt data)")

    def tree(self, values: bool = True) -> Any:
        if self._tree is not None:
            return self._tree
        self.check_small()
        if self.byteorder != sys.byteorder:
            raise FormatError(f"{self.path}: {self.byteorder}-endian data; this command reads native "
                              f"({sys.byteorder}-endian) archives piece by piece")
        path, recs = self.path, self.archive.records
        reader = Reader(self.archive, self.small, {})

        def on_storage(pid, untyped) -> None:
            _, stype, key, location, numel = pid
            if not isinstance(key, str) or not isinstance(numel, int) or not isinstance(location, str):
                raise FormatError(f"{path}: data.pkl is damaged: storage id {pid!r}")
            name = f"data/{key}"
            rec = recs.get(name)
            if rec is None:
                raise FormatError(f"{path}: data.pkl refers to record {name!r}, which is missing")
            untyped_type = stype is torch.UntypedStorage
            dtype = torch.uint8 if untyped_type else stype.dtype
            nbytes = numel * itemsize(dtype)
            if nbytes != rec.size:
                raise FormatError(f"{path}: record {name!r} holds {rec.size} bytes, data.pkl expects {nbytes}")
            s = self.storages[name]
            if name not in self._used:
                s.dtype, s.untyped, s.location = dtype, untyped_type, location
                self._used[name] = s
            setattr(untyped, STORAGE_ATTR, s)

        # the size and nesting guards of fastckpt's walk first: torch's unpickler would hash a
        # deeply nested key (a C stack overflow) or grow its stack and memo as the file says
        plain: List[bool] = []
        _unpickle.check(self.small.get("data.pkl", b""), f"{path}: data.pkl", plain=plain)
        if plain and plain[0]:
            # a plain state dict: the C unpickler builds the tree torch's would (as fastckpt.load
            # does); anything it does not know, or any other error, and torch's decides below
            try:
                self._tree = load_plain(reader, "meta", {"encoding": "utf-8"},
                                        meta_storage=on_storage)
                return self._tree
            except (FormatError, OSError):
                raise
            except Exception:  # noqa: BLE001 - decided again, and reported, by torch's unpickler
                pass
        unpickler = type("_Unpickler", (_MetaUnpickler,), {"on_storage": staticmethod(on_storage)})
        module = types.SimpleNamespace(Unpickler=unpickler)
        try:
            self._tree = ts._load(reader, "meta", module, encoding="utf-8")
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"{path}: the weights-only unpickler refused data.pkl ({e}). Nothing from the file was run; "
                "this command only reads checkpoints that load with weights_only=True") from None
        except (FormatError, OSError):
            raise
        except Exception as e:
            raise FormatError(f"{path}: data.pkl is damaged and cannot be unpickled ({type(e).__name__}: {e})") \
                from None
        return self._tree

    def crc_error(self, storage: Storage) -> FormatError:
        return FormatError(f"{self.path}: checksum mismatch in record {storage.key!r} (corrupt data)")

    def _checked(self, storage: Storage, start: int, length: int) -> bool:
        return bool(self.verify and storage.crc and start == 0 and length == storage.nbytes)

    def stream(self, storage, start, length, consume, on_read=None, on_crc=None) -> None:
        if on_crc is not None or not self._checked(storage, start, length):
            return super().stream(storage, start, length, consume, on_read, on_crc)
        crc = 0

        def fold(piece_crc: int, n: int) -> None:  # the pieces' CRC-32s, computed by the engine's reads
            nonlocal crc
            crc = _engine.crc32_combine(crc, piece_crc, n)
        super().stream(storage, start, length, consume, on_read, fold)
        if crc != storage.crc:
            raise self.crc_error(storage)

    def read_span(self, storage: Storage, start: int, length: int) -> torch.Tensor:
        if not self._checked(storage, start, length):
            return super().read_span(storage, start, length)
        buf = aligned_buffer(length)
        if self.read_crc(storage, start, buf) != storage.crc:
            raise self.crc_error(storage)
        return buf

    def read(self, storage: Storage, offset: int, out: torch.Tensor) -> None:
        self._read(storage, offset, out, False)

    def read_crc(self, storage: Storage, offset: int, out: torch.Tensor) -> int:
        return self._read(storage, offset, out, True)

    def _read(self, storage: Storage, offset: int, out: torch.Tensor, crc: bool) -> Optional[int]:
        return self.records.read_into([(storage.key, offset, out, crc)])[0]

    def read_many(self, items: List[Tuple[Storage, int, torch.Tensor, bool]]) -> List[Optional[int]]:
        return self.records.read_into([(s.key, off, out, crc) for s, off, out, crc in items])

    def check_crcs(self, storages: List[Storage], progress: Optional[Callable[[int], None]] = None
                   ) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        """Check storages read whole against their CRC-32s, in order: yields
        (storage, None) for a match, (storage, error) for a mismatch
        (FormatError) or a read that failed (OSError, FormatError). Small
        records are read many at a time (up to CHUNK bytes per engine call),
        large ones streamed; the engine computes the CRC-32s during the reads.
        Memory stays at a few CHUNKs. ``progress(nbytes)`` as bytes are checked."""
        batch: List[Storage] = []
        size = 0
        for s in storages:
            if s.nbytes > CHUNK // 8:
                if batch:
                    yield from self._check_batch(batch, progress)
                    batch, size = [], 0
                yield from self._check_one(s, progress)
                continue
            if batch and size + s.nbytes > CHUNK:
                yield from self._check_batch(batch, progress)
                batch, size = [], 0
            batch.append(s)
            size += s.nbytes
        if batch:
            yield from self._check_batch(batch, progress)

    def _check_batch(self, batch: List[Storage], progress) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        buf = aligned_buffer(sum(s.nbytes for s in batch))
        items, at = [], 0
        for s in batch:
            items.append((s.key, 0, buf[at:at + s.nbytes], True))
            at += s.nbytes
        try:
            crcs = self.records.read_into(items)
        except (OSError, FormatError):  # one by one, to say which record cannot be read
            for s in batch:
                yield from self._check_one(s, progress)
            return
        for s, crc in zip(batch, crcs):
            if progress:
                progress(s.nbytes)
            yield s, (None if crc == s.crc else self.crc_error(s))

    def _check_one(self, s: Storage, progress) -> Iterator[Tuple[Storage, Optional[BaseException]]]:
        crc = 0

        def fold(piece_crc: int, n: int) -> None:
            nonlocal crc
            crc = _engine.crc32_combine(crc, piece_crc, n)
        try:
            self.stream(s, 0, s.nbytes, lambda piece: progress(piece.numel()) if progress else None, on_crc=fold)
        except (OSError, FormatError) as e:
            yield s, e
            return
        yield s, (None if crc == s.crc else self.crc_error(s))
