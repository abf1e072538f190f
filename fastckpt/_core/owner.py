"""Refusing checkpoint directories that somebody else controls.

A training job writes its checkpoints into a directory and later trusts what
it finds there (the manager follows `latest`, removes temporaries, prunes old
steps; DCP reads `.metadata` and the data files it names). Anyone who can
write into that directory can plant a ``step_99999999.pt``, a ``latest`` or a
``.metadata`` of their choosing between those steps, so fastckpt refuses, as
git refuses a repository owned by another user, a directory that:

* is owned by another user than this process's effective user or root;
* is writable by every user (``o+w``), with or without the sticky bit: the
  sticky bit (``/tmp``, ``/dev/shm``) stops others from removing or renaming
  our files but not from creating new names, which is all a planted
  checkpoint needs; this holds for root too;
* is writable by its group (``g+w``), unless that group is this user's own
  private group (the user-private-group convention of ``umask 002`` systems:
  a group named like the user, listing no other member). Any other group
  means other people can write there.

``FASTCKPT_ALLOW_FOREIGN_OWNER=1`` (or
``fastckpt.knobs.override(allow_foreign_owner=1)``) trusts such a directory,
for one shared on purpose.

Only the directory itself is checked, not its ancestors. Single files given to
:func:`fastckpt.load` are not checked: loading a published checkpoint from a
shared directory is normal, and with weights-only unpickling (the default, as in torch.load)
nothing in the file can run code.
"""

import errno
import os
import stat
from typing import Optional, Union

from .. import knobs

__all__ = ["check_directory_owner"]

_OPT_OUT = ("Set FASTCKPT_ALLOW_FOREIGN_OWNER=1 or use fastckpt.knobs.override(allow_foreign_owner=1) to trust it")


def _user(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp
        return f"group {grp.getgrgid(gid).gr_name} (gid {gid})"
    except (ImportError, KeyError):
        return f"gid {gid}"


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s user-private group: named like the user,
    with no member listed other than the user."""
    try:
        import grp
        import pwd
        user = pwd.getpwuid(uid).pw_name
        g = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return g.gr_name == user and set(g.gr_mem) <= {user}


def _writable_by_others(st: os.stat_result, me: int) -> Optional[str]:
    """Who else can write into a directory with this stat, or None."""
    if st.st_mode & stat.S_IWOTH:
        sticky = " (the sticky bit stops others from removing files, not from creating them)" \
            if st.st_mode & stat.S_ISVTX else ""
        return f"every user{sticky}"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, me):
        return f"the members of {_group(st.st_gid)}"
    return None


def check_directory_owner(path: Union[str, os.PathLike], what: str = "checkpoint directory") -> None:
    """Raise PermissionError (EPERM, filename = ``path``) when the existing
    directory ``path`` is owned by another user than this process's effective
    user (or root), or when others can write into it (see the module's
    docstring). A missing directory passes (whoever creates it owns it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if knobs.get("allow_foreign_owner"):
        return
    me = os.geteuid()
    p = os.fspath(path)
    if st.st_uid not in (me, 0):
        raise PermissionError(
            errno.EPERM,
            f"{p} is owned by {_user(st.st_uid)}, not by this process's {_user(me)}: refusing it as a {what} "
            f"(its owner could replace or plant files in it). {_OPT_OUT}", p)
    others = _writable_by_others(st, me) if stat.S_ISDIR(st.st_mode) else None
    if others:
        raise PermissionError(
            errno.EPERM,
            f"{p} is writable by {others}: refusing it as a {what} (anyone who can write there could plant a "
            f"checkpoint such as step_99999999.pt, a `latest` or a `.metadata` of their choosing). Use a directory "
            f"only you can write (chmod go-w {p}, or a subdirectory of your own). {_OPT_OUT}", p)
