"""Saves and loads of one torch.save file by every rank of a process group:
each rank writes or reads a share, the shares are checked and exchanged over
the group, and any rank's failure fails every rank."""

from .save import PLACEMENTS

__all__ = ["PLACEMENTS"]
