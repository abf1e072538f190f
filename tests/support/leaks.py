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
