"""Step names: the one format and parse of ``step_<N>`` names.

A CheckpointManager directory names its checkpoints ``step_<N>.pt`` (one
file each) or ``step_<N>`` (a DCP directory each), N zero-padded to 8 digits;
the remote tier's store keeps each step under the unpadded prefix
``step_<N>/`` (the keys its stored manifests already use). Every reader of
such names (the manager, the remote manifest, ``fastckpt inspect`` and
``verify``) parses them here, so that they agree on what a step name is.
"""

import re
from typing import Optional, Tuple

__all__ = ["FILE_SUFFIX", "LOCAL_WIDTH", "step_name", "split_step_name", "parse_step_name"]

FILE_SUFFIX = ".pt"   # a replicated checkpoint: one file
LOCAL_WIDTH = 8       # digits of a checkpoint directory's names; the remote store's are unpadded (0)

_NAME = re.compile(r"step_(\d+)(\.pt)?")


def step_name(step: int, suffix: str = "", width: int = LOCAL_WIDTH) -> str:
    """``step_<step>`` padded to `width` digits, then `suffix` (``""`` or :data:`FILE_SUFFIX`)."""
    return f"step_{int(step):0{width}d}{suffix}"


def split_step_name(name: str) -> Optional[Tuple[int, str]]:
    """``(step, suffix)`` of a step name (suffix ``""`` or ``".pt"``), padded or
    not; None for any other name."""
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


def parse_step_name(name: str, suffix: str = "") -> Optional[int]:
    """The step of a name with exactly that `suffix`, else None."""
    parsed = split_step_name(name)
    return parsed[0] if parsed is not None and parsed[1] == suffix else None
