"""fastckpt.integrations: `import fastckpt` imports none of them, and each one whose
framework is missing raises ImportError naming the pip package to install."""
import os
import subprocess
import sys

import pytest

import paths

ROOT = str(paths.ROOT)

# module -> (the framework module hidden, the pip package the error must name)
CASES = {
    "lightning": ("lightning", "lightning"),
    "accelerate": ("accelerate", "accelerate"),
    "transformers": ("transformers", "transformers"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "torchtitan": ("torchtitan", "torchtitan"),
}


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.parametrize("name", sorted(CASES))
def test_missing_framework_is_an_import_error_naming_the_package(name):
    hidden, pip_name = CASES[name]
    r = run(f"""
import sys
sys.modules[{hidden!r}] = None  # as if not installed
try:
    import fastckpt.integrations.{name}
except ImportError as e:
    print("ERR", e)
else:
    print("imported")
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR"), r.stdout
    assert f"pip install {pip_name}" in r.stdout and f"fastckpt-io[{name}]" in r.stdout, r.stdout


def test_import_fastckpt_imports_no_framework():
    r = run("""
import sys, fastckpt, fastckpt.integrations
print(sorted(m for m in ("lightning", "accelerate", "transformers", "deepspeed", "torchtitan") if m in sys.modules))
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
