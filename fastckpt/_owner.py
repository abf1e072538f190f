"""Refusing checkpoint directories that another user owns.

A training job writes its checkpoints into a directory and later trusts what
it finds there (the manager follows `latest`, removes temporaries, prunes old
steps; DCP reads `.metadata` and the data files it names). When somebody else
owns that directory, they can swap files, plant symlinks or a `latest` of
their choosing between those steps, so fastckpt refuses it, as git refuses a
repository owned by another user. Directories owned by the process's
effective user or by root are trusted. ``FASTCKPT_ALLOW_FOREIGN_OWNER=1`` (or
``fastckpt.knobs.override(allow_foreign_owner=1)``) trusts any owner, for a
directory shared on purpose.

Single files given to :func:`fastckpt.load` are not checked: loading a
published checkpoint from a shared directory is normal, and with
``weights_only=True`` (the default) nothing in the file can run code.
"""

import errno
import os
from typing import Union

from . import knobs

__all__ = ["check_directory_owner"]


def _user(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_directory_owner(path: Union[str, os.PathLike], what: str = "checkpoint directory") -> None:
    """Raise PermissionError when the existing directory ``path`` is owned by
    another user than this process's effective user (or root). A missing
    directory passes (whoever creates it owns it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if st.st_uid in (me, 0) or knobs.get("allow_foreign_owner"):
        return
    p = os.fspath(path)
    raise PermissionError(
        errno.EPERM,
        f"{p} is owned by {_user(st.st_uid)}, not by this process's {_user(me)}: refusing it as a {what} "
        "(its owner could replace or plant files in it). Set FASTCKPT_ALLOW_FOREIGN_OWNER=1 or use "
        "fastckpt.knobs.override(allow_foreign_owner=1) to trust it", p)
