"""``python -m fastckpt``: the fastckpt command (see fastckpt/cli.py)."""

import sys

from .cli import main

sys.exit(main())
