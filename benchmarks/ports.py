"""Free TCP ports for the benchmarks' rendezvous (no torch import: cluster_emulate's parent stays
light)."""
import random
import socket


def free_port() -> int:
    """A free TCP port for a benchmark's rendezvous, drawn at random from below the kernel's
    ephemeral range and probed with a bind. Not bind(0): the kernel hands that port out again as
    the local port of an outgoing connection, and between this probe and the store's bind a
    connection of a job running beside the benchmark (the test suite runs benchmarks in parallel
    with other tests) can take it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            end = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        end = 32768
    lo = 20000 if end > 21000 else 1024
    rng = random.Random()  # its own, so that a benchmark's seeded random does not repeat ports
    for _ in range(200):
        port = rng.randrange(lo, end)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    with socket.socket() as s:  # everything below the range taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
