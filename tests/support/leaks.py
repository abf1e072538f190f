"""What an operation may leave behind: open descriptors and temporary files (the leak checks that
follow every failure path)."""
import gc
import os


def fd_table():
    """This process's open descriptors -> what they point at, sockets left out:
    the leak checks compare descriptors before and after an operation on files,
    which opens no socket, while sockets of earlier tests' network clients and
    their threads come and go on their own (under xdist such changes made three
    fault tests see the count drop by 1-2 during the test)."""
    gc.collect()  # engines of earlier tests close their io_uring descriptors
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
        if not target.startswith("socket:"):
            out[fd] = target
    return out


def fd_count():
    """How many descriptors :func:`fd_table` lists."""
    return len(fd_table())


def temp_files(directory):
    return sorted(n for n in os.listdir(directory) if ".fastckpt-tmp." in n)


def temps_of(directory, target, kind="any"):
    """The temporaries in ``directory`` of saves of ``target`` (a base name),
    either name format; ``kind``: "any", None (the engine's files) or one of
    the directories' suffixes."""
    from fastckpt._core.tempnames import parse_temp
    out = []
    for n in os.listdir(directory):
        t = parse_temp(n)
        if t is not None and t.is_for(target) and (kind == "any" or t.kind == kind):
            out.append(n)
    return sorted(out)


def temp_name_of(target, pid, host, start, n=0, r="1a2b", kind=None, fmt="current"):
    """A temporary name as a save of ``target`` (a base name) by process
    ``pid`` of ``host`` would make it: ``fmt`` "current"
    (``.fastckpt-tmp.<key>...``) or "earlier" (``.<target>.fastckpt-tmp...``,
    still recognised for cleanup); ``kind``: the directories' suffix."""
    from fastckpt import _C
    fields = f"{pid}.{host}.{start}.{n}.{r}"
    name = (f".fastckpt-tmp.{_C.temp_key(target)}.{fields}" if fmt == "current"
            else f".{target}.fastckpt-tmp.{fields}")
    return name if kind is None else f"{name}.{kind}"
