"""A short run of the crash driver's re-save kinds (tests/crash/crash_driver.py): a sharded
CheckpointManager re-saving its step, ``fastckpt convert --to dcp --force``,
``fastckpt.safetensors.save_sharded`` and ``dcp.save`` with FastWriter, each over its own
existing checkpoint directory, SIGKILLed at random moments (during writes, fsyncs, the renames
of the directory commit, with the exchange refused, and before the old copy's removal). After
each kill fastckpt's reader loads the old checkpoint or the complete new one, and a manager
start's cleanup leaves the final name holding it. The full run:
``python tests/crash/crash_driver.py --kinds resave_manager,resave_convert,resave_st,resave_dcp --kills 200``."""
import re
import sys

import fastspawn
from paths import TESTS

DRIVER = str(TESTS / "crash" / "crash_driver.py")
KINDS = ("resave_manager", "resave_convert", "resave_st", "resave_dcp")
KILLS = 3  # per kind


def test_resaves_killed_at_random_moments_leave_old_or_new(tmp_path):
    r = fastspawn.run([sys.executable, DRIVER, "--kills", str(KILLS * len(KINDS)), "--kinds", ",".join(KINDS),
                       "--seed", "13", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"total kills={KILLS * len(KINDS)} violations=0" in out, out
    for kind in KINDS:
        assert re.search(rf"^  {kind} +[0-9.]+ s kills= *{KILLS} ", out, re.M), out
