"""The layout of a torch.save archive as fastckpt writes it (docs/FORMAT.md
1.3): the records, their order and alignment, every offset known before the
first byte is written."""

import sys
import uuid
from typing import Any, List, Optional


from . import zip as _zip


ARCHIVE_NAME = "archive"


FORMAT_VERSION = b"3\n"  # the archive's "version" record, as torch 2.x writes it


def new_serialization_id() -> bytes:
    """The archive's .data/serialization_id record: 40 random decimal digits, as torch writes."""
    return f"{uuid.uuid4().int:040d}"[:40].encode()


def plan_archive(data_pkl: bytes, storages: List[Any], alignment: int, byteorder: bool = True,
                  direct_min: Optional[int] = _zip.DIRECT_MIN, serialization_id: Optional[bytes] = None):
    """The layout of the archive :func:`write_archive` writes (docs/FORMAT.md 1.3):
    every offset is known before the first byte is written. Every record is on
    one alignment, :func:`fastckpt.formats.zip.storage_alignment` of the
    storages' sizes (`alignment`, or a multiple of it and of 4096), which the
    ``.storage_alignment`` record states, with torch.save's ``.format_version``
    record: stock torch.load may compute the storages' offsets from it. Returns (plan,
    entries, cd_offset, file_size): plan[i] = (payload bytes or storage, local
    header bytes, its _zip.Entry) in file order, the storages' records being
    "data/<i>"; the central directory starts at cd_offset. Each record is
    followed by its data descriptor (none for empty ones)."""
    if serialization_id is None:
        serialization_id = new_serialization_id()
    sizes = [s.nbytes() for s in storages]
    alignment = _zip.storage_alignment(sizes, alignment, direct_min)
    head = [("data.pkl", data_pkl), (".format_version", b"1"), (".storage_alignment", str(alignment).encode())]
    if byteorder:
        head.append(("byteorder", sys.byteorder.encode()))
    tail = [("version", FORMAT_VERSION), (".data/serialization_id", serialization_id)]

    # (One plain loop: it runs once per record, 100,000 times for 100,000 scalars.)
    records = [(name, payload, len(payload), alignment) for name, payload in head]
    records += [(f"data/{i}", s, n, alignment) for i, (s, n) in enumerate(zip(storages, sizes))]
    records += [(name, payload, len(payload), alignment) for name, payload in tail]
    plan = []  # (payload bytes or storage, header, entry)
    entries = []
    pos = 0
    u32 = _zip.U32_MAX
    local_header, Entry = _zip.local_header, _zip.Entry
    for name, payload, size, align in records:
        full = f"{ARCHIVE_NAME}/{name}"
        header = local_header(full.encode(), size, pos, align)
        entry = Entry(full, size, 0, pos, pos + len(header))
        pos += len(header) + size + (0 if size == 0 else 24 if size >= u32 or entry.header_offset >= u32 else 16)
        plan.append((payload, header, entry))
        entries.append(entry)
    return plan, entries, pos, pos + _zip.central_directory_size(entries, pos)

