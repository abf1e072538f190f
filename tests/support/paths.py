"""Where things are: the checkout, the tests, the helpers, the workers and the test data.

Tests and helpers name files by these, never by their own location, so that moving a test module
between the folders of tests/python/ changes no path.
"""
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support: on sys.path (tests/conftest.py)
TESTS = SUPPORT.parent
ROOT = TESTS.parent  # the checkout: fastckpt/, benchmarks/, examples/
WORKERS = SUPPORT / "workers"
DATA = SUPPORT / "data"
