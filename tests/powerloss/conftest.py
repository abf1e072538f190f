"""Prints the power-loss tests' counts (cut points, crash states checked, violations) at the end."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("test_powerloss")
    reports = getattr(mod, "REPORTS", None)
    if reports:
        terminalreporter.section("power-loss counts")
        for line in reports:
            terminalreporter.write_line(line)
