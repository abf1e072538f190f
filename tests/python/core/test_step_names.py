"""Step names have one format and one parse (fastckpt/_core/steps.py), used by
the manager's directory, the remote store's prefixes and the CLI."""

from fastckpt._core.steps import FILE_SUFFIX, parse_step_name, split_step_name, step_name
from fastckpt.manager.policy import StepDirectory
from fastckpt.remote import manifest


def test_formats_keep_the_names_on_disk(tmp_path):
    assert step_name(7) == "step_00000007" and step_name(7, FILE_SUFFIX) == "step_00000007.pt"
    assert manifest.step_prefix(7) == "step_7" and manifest.manifest_key(7) == "step_7/fastckpt-manifest.json"
    assert StepDirectory(tmp_path, None, sharded=False).name_for(123456789) == "step_123456789.pt"
    assert StepDirectory(tmp_path, None, sharded=True).name_for(3) == "step_00000003"


def test_one_parse_for_padded_and_unpadded_names():
    assert split_step_name("step_00000007.pt") == (7, ".pt")
    assert split_step_name("step_7") == (7, "")
    for bad in ("step_", "step_7.pt.tmp", ".step_7", "step_7/", "step_x", "latest", "step_7.PT"):
        assert split_step_name(bad) is None, bad
    assert parse_step_name("step_7") == 7 and parse_step_name("step_7.pt") is None
    assert parse_step_name("step_7.pt", FILE_SUFFIX) == 7 and parse_step_name("step_7", FILE_SUFFIX) is None


def test_the_readers_agree(tmp_path):
    d = StepDirectory(tmp_path, None, sharded=False)
    s = StepDirectory(tmp_path, None, sharded=True)
    for name in ("step_00000042.pt", "step_42.pt", "step_00000042", "step_42", "step_42.pt.fastckpt-tmp.1"):
        parsed = split_step_name(name)
        assert d.parse(name) == (parsed[0] if parsed and parsed[1] == ".pt" else None)
        assert s.parse(name) == (parsed[0] if parsed and parsed[1] == "" else None)
