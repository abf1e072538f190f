"""Free TCP ports for the servers the tests start (rendezvous stores, the S3 endpoint).

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the
range it also draws the local ports of outgoing connections from: between the
test closing its probe socket and the server binding the port, another test's
gloo or HTTP client (a parallel xdist worker, a rank of another job) can take it
as its local port, and the server fails with EADDRINUSE (a flaky test that seems
to be about something else). So ports here come from below the ephemeral range,
a slice of it per xdist worker (no two workers hand out the same port), each
probed with a bind and never handed out twice by one process.
"""
import itertools
import os
import socket

_BASE = 12000  # the ports handed out lie in [_BASE, the ephemeral range's start)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice():
    """This process's ports: the xdist worker's slice of the range, started at the pid."""
    end = max(_ephemeral_start(), _BASE + 1024)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = (end - _BASE) // count
    lo = _BASE + (index % count) * width
    start = os.getpid() % width
    return [lo + (start + i) % width for i in range(width)]


_candidates = None


def _bindable(port: int) -> bool:
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 here: the IPv4 probe decides
                continue
            return False
    return True


def free_port() -> int:
    """A port nothing listens on or is connected from, outside the ephemeral range."""
    global _candidates
    if _candidates is None:
        _candidates = itertools.cycle(_slice())
    for _ in range(4096):
        port = next(_candidates)
        if _bindable(port):
            return port
    raise OSError("no free TCP port below the ephemeral range")
