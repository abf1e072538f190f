"""The tests' torchrun launchers (dist_launch.py): what each rank prints reaches the test whole,
line by line, however the ranks of one agent interleave their writes (the tests parse those lines;
an unbuffered ``print("A", b)`` is one write per piece)."""
import textwrap

from dist_launch import torchrun, torchrun_nodes

N = 300


def _script(tmp_path):
    s = tmp_path / "chatty.py"
    s.write_text(textwrap.dedent(f"""\
        import os, sys
        r = os.environ["RANK"]
        for i in range({N}):
            print("LINE", r, i, "x" * 40, "end", flush=True)  # five writes per line (PYTHONUNBUFFERED)
            print("ERR", r, i, file=sys.stderr, flush=True)
        """))
    return s


def _check(stdout, stderr, world):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("LINE")]
    want = sorted(f"LINE {r} {i} {'x' * 40} end" for r in range(world) for i in range(N))
    assert sorted(lines) == want  # every line whole, none lost
    errs = [ln for ln in stderr.splitlines() if ln.startswith("ERR")]
    assert sorted(errs) == sorted(f"ERR {r} {i}" for r in range(world) for i in range(N))


def test_the_ranks_of_one_agent_reach_the_test_line_by_line(tmp_path):
    r = torchrun(_script(tmp_path), nproc=2, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(r.stdout, r.stderr, 2)


def test_each_emulated_node_gives_its_own_ranks_lines(tmp_path):
    res = torchrun_nodes(_script(tmp_path), node_env=[{}, {}], nproc=2, timeout=120)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    for node, r in enumerate(res):
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("LINE")]
        assert {ln.split()[1] for ln in lines} == {str(2 * node), str(2 * node + 1)}
    _check("".join(r.stdout for r in res), "".join(r.stderr for r in res), 4)
