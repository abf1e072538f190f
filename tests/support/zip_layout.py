"""The records of a zip archive as the local headers place them, read with
zipfile (not fastckpt's parser), and the alignment rule of docs/FORMAT.md 1.3
checked against them: for the tests of the writer's layout."""

import math
import struct
import zipfile
from pathlib import Path

DIRECT_MIN = 65536  # the threshold of docs/FORMAT.md 1.3, spelled out


def record_layout(path, verify_crcs=False):
    """{record name without the top folder: (data offset, size, crc)}, the data
    offset computed from each local header (header_offset + 30 + name + extra);
    with `verify_crcs`, zipfile checks every record's CRC-32 too."""
    raw = Path(path).read_bytes()
    out = {}
    with zipfile.ZipFile(path) as z:
        assert not verify_crcs or z.testzip() is None
        for info in z.infolist():
            h = info.header_offset
            assert raw[h:h + 4] == b"PK\x03\x04", info.filename
            name_len, extra_len = struct.unpack_from("<HH", raw, h + 26)
            assert raw[h + 30:h + 30 + name_len].decode() == info.filename
            out[info.filename.split("/", 1)[1]] = (h + 30 + name_len + extra_len, info.file_size, info.CRC)
    return out


def assert_layout_rule(path, alignment=64, verify_crcs=False):
    """docs/FORMAT.md 1.3: torch.save's .format_version record, and every record
    on the one alignment .storage_alignment states (torch predicts storage
    offsets from it): lcm(4096, `alignment`) where the file has a storage of
    64 KiB or more and padding its small ones costs at most 1/64 of the data or
    1 MiB, else `alignment` (torch's storage_alignment). Returns record_layout(path)."""
    layout = record_layout(path, verify_crcs)
    assert ".format_version" in layout
    with zipfile.ZipFile(path) as z:
        stated = int(z.read(next(i for i in z.infolist() if i.filename.endswith("/.storage_alignment"))))
    large = math.lcm(4096, alignment)
    sizes = [size for n, (_, size, _) in layout.items() if n.startswith("data/")]
    assert stated == (large if any(s >= DIRECT_MIN for s in sizes) and
                      sum(s < DIRECT_MIN for s in sizes) * large <= max(1 << 20, sum(sizes) // 64) else alignment)
    for n, (off, size, _) in layout.items():
        assert off % stated == 0, f"{n} ({size} bytes) starts at {off}, not on a multiple of {stated}"
    return layout
