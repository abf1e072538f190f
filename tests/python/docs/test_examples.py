"""The examples the README shows run, and do what it says."""
import re

from dist_launch import torchrun
from paths import ROOT


def _torchrun(script, *args):
    r = torchrun(ROOT / "examples" / script, *args, nproc=2, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return sorted(re.findall(r"rank \d+: trained steps \d+\.\.\d+, weight sum -?[\d.]+", r.stdout))


def test_ddp_checkpoint_resumes_exactly(tmp_path):
    first = _torchrun("ddp_checkpoint.py", tmp_path / "a", 5)
    second = _torchrun("ddp_checkpoint.py", tmp_path / "a", 5)
    straight = _torchrun("ddp_checkpoint.py", tmp_path / "b", 10)
    assert [l.split(",")[0] for l in first] == ["rank 0: trained steps 0..4", "rank 1: trained steps 0..4"]
    assert [l.split(",")[0] for l in second] == ["rank 0: trained steps 5..9", "rank 1: trained steps 5..9"]
    sums = {l.split("weight sum ")[1] for l in second}
    assert len(sums) == 1, second                   # every rank loaded the same state
    assert sums == {l.split("weight sum ")[1] for l in straight}  # and resumed exactly
    assert sums != {l.split("weight sum ")[1] for l in first}


def test_the_guide_shows_the_example_as_it_is():
    code = (ROOT / "examples" / "ddp_checkpoint.py").read_text()
    body = code.split('"""\n', 1)[1].strip()  # without the module docstring
    assert body in (ROOT / "docs" / "guide" / "ddp.md").read_text(), \
        "docs/guide/ddp.md's copy of examples/ddp_checkpoint.py is stale"
