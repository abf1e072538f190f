"""safetensors files by hand: a file's bytes from a header and data (to craft the files no writer
writes), and the JSON header of a file on disk (to compare what two writers recorded)."""
import json
import struct
from typing import Tuple


def crafted(header, data: bytes = b"") -> bytes:
    """A safetensors file: the 8-byte little-endian length, `header` as JSON, `data`."""
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def header_of(path) -> Tuple[int, dict]:
    """(where the data starts, the JSON header) of the safetensors file at `path`."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))
