"""``python -m fastckpt``: the fastckpt command (see fastckpt/cli.py)."""

import sys

from .cli.main import main

sys.exit(main())
