"""Byte counts for people: the one size formatter of the command's output
(inspect, verify, convert, doctor) and of the benchmark report."""

from typing import Optional

__all__ = ["human"]


def human(n: Optional[int], digits: int = 1, trim: bool = False) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 GiB`` (binary units, `digits` decimals;
    ``?`` for an unknown size). With `trim`, a whole number of its unit is
    written without decimals (``2 GiB``)."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024.0
        if v < 1024 or unit == "PiB":
            return f"{int(v)} {unit}" if trim and v == int(v) else f"{v:.{digits}f} {unit}"
    return str(n)  # not reached
