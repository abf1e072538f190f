"""Loads whose storages go to a device: each storage's destination decided
while torch unpickles, its bytes read in chunks into the staging pool and
copied to the device while the next chunks are read."""

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.serialization as ts

from .. import _C
from .._core.engine import get_engine
from ..formats import pickle_scan, zip as _zip
from ..staging import device as _staging
from ..staging.todevice import LoadJob, load_into_device
from .reader import SMALL_RECORDS, Records, host_storage, no_checksums, parse_checkpoint
from .writer import as_bytes_tensor
from ..formats.torch_rules import MapLocation


def moves_off_cpu(map_location: MapLocation, fd: int = -1) -> bool:
    """Whether `map_location` may put storages on a device (then load() reads
    them through the staging pool: :class:`DeviceRecords`). Without a
    map_location, whether the start of the file (data.pkl comes first) names
    a device location that a copier knows: one 64 KiB read."""
    if map_location is None:
        if fd < 0:
            return False
        head = os.pread(fd, 64 << 10, 0)
        tags = pickle_scan.location_tags(head)
        return any(_staging.copier_for_location(t) is not None for t in tags)
    if callable(map_location):
        return True
    values = map_location.values() if isinstance(map_location, dict) else [map_location]
    return any(_staging.copier_for_location(v) is not None for v in values)


class DeviceRecords(dict):
    """load() with a map_location that moves storages to a device: no storage
    is read up front. While torch unpickles, each storage's destination is
    decided from its location tag (string, torch.device and dict map_locations
    as torch decides them); a storage bound for a device gets an empty device
    storage now and its bytes in :meth:`finish`,
    read in chunks into the staging pool and copied to the device while the
    next chunks are read (host memory: the pool, not the checkpoint). Storages
    that stay on the host are read as :class:`Records` reads them. A
    callable map_location is called once per storage, as by torch, with a
    storage of the right size whose bytes are filled after it returns (into
    the device storage it returns, through the pool; or into the host storage
    it returns): it must not look at the bytes."""

    def __init__(self, path: str, archive: "_zip.Archive", host: "Records", map_location: MapLocation):
        super().__init__()
        self.path, self.archive, self.host, self.map_location = path, archive, host, map_location
        self.restore = ts._get_restore_location(map_location)
        self.jobs: List[LoadJob] = []
        self.host_jobs: List[Tuple[str, torch.UntypedStorage]] = []
        self._dest: Dict[str, Any] = {}
        self._name: Optional[str] = None

    def get(self, name, default=None):
        rec = self.archive.records.get(name)
        if rec is None:
            return default
        self._name = name  # torch restores the storage it asked for right after
        return torch.empty(rec.size, dtype=torch.uint8, device="meta")

    def _destination(self, location: str):
        if location not in self._dest:
            ml = self.map_location
            target = ml.get(location, location) if isinstance(ml, dict) else location if ml is None else ml
            self._dest[location] = _staging.copier_for_location(target)
            if self._dest[location] is None and isinstance(target, (str, torch.device)):
                try:
                    if torch.device(target).type == "cpu":
                        self._dest[location] = "cpu"
                except (RuntimeError, TypeError, ValueError):
                    pass
        return self._dest[location]

    def restore_location(self, storage, location):
        name, self._name = self._name, None
        if name is None:
            return self.restore(storage, location)
        rec = self.archive.records[name]
        if callable(self.map_location):
            # The callable is called once per storage, as torch calls it, with a
            # storage of the record's size and location whose bytes are filled
            # after it returns (through the pool if it moved it to a device).
            r = self.restore(host_storage(rec.size, rec.data_offset).untyped_storage(), location)
            u = r._untyped_storage if isinstance(r, torch.storage.TypedStorage) else r
            if isinstance(u, torch.UntypedStorage) and u.nbytes() == rec.size:
                copier = _staging.copier_for(u)
                if copier is not None:
                    self.jobs.append(LoadJob(name, rec.data_offset, rec.size, u, copier))
                elif u.device.type == "cpu":
                    self.host_jobs.append((name, u))
                else:  # another accelerator: a plain copy of the bytes read now
                    u.copy_(self.host.read_late(name, storage=True).untyped_storage())
            return r
        dest = self._destination(location) if isinstance(location, str) else None
        if dest == "cpu":  # stays on the host: read with the others, in one batch
            u = host_storage(rec.size, rec.data_offset).untyped_storage()
            self.host_jobs.append((name, u))
            return self.restore(u, location)
        if dest is None:  # an unknown place: read now, restore as torch does
            t = self.host[name] if name in self.host else self.host.read_late(name, storage=True)
            return self.restore(t.untyped_storage(), location)
        copier, device = dest
        dst = copier.empty_device(rec.size, device)
        # Filled after the unpickling: until then no tensor may stretch it (torch's error, as on the host);
        # resizable again in finish(), as torch's restored device storages are.
        _C.set_resizable(as_bytes_tensor(dst), False)
        self.jobs.append(LoadJob(name, rec.data_offset, rec.size, dst, copier))
        return dst

    def unseal(self) -> None:
        """After :meth:`finish`: the device storages resizable, as torch's restored ones are."""
        for j in self.jobs:
            _C.set_resizable(as_bytes_tensor(j.dst), True)

    def finish(self, verify: Optional[bool]) -> List[str]:
        """Read every deferred storage (device-bound ones through the pool,
        host ones a callable map_location kept on the host in one parallel
        batch); returns the names of records that fail their CRC with `verify`."""
        path = self.path
        recs = self.archive.records
        if not self.jobs and not self.host_jobs:
            return []
        # The file is open again (the unpickler ran after it was closed): it
        # must be the one the archive was parsed from.
        with self.host.reopened() as fd:
            def read(ranges, crc):
                return _C.read_ranges(get_engine(), path, ranges, fd, crc).get("crcs")

            self.host.claim([n for n, _ in self.host_jobs])
            # host-bound storages: one batch, CRC-32s computed by the engine during the reads
            host_crcs = self.host.read_into([(n, 0, as_bytes_tensor(u), verify is not False)
                                             for n, u in self.host_jobs])
            load_into_device(read, self.jobs, verify is not False)
        if verify is False:
            return []
        names = [n for n in [j.name for j in self.jobs] + [n for n, _ in self.host_jobs] + list(self.host)
                 if recs[n].size]
        if names and all(recs[n].crc == 0 for n in names):
            no_checksums(path, verify)
            return []
        bad = [j.name for j in self.jobs if j.crc != recs[j.name].crc]
        bad += [n for (n, _), crc in zip(self.host_jobs, host_crcs) if (crc or 0) != recs[n].crc]
        return bad + self.host.bad(list(self.host))


def open_for_device(path: str, fh, verify: Optional[bool], map_location: MapLocation):
    """As :func:`read_archive` for a load onto a device: (archive, small
    records, DeviceRecords), or None where the device path does not apply
    (a file of the other byte order: torch byteswaps the host storages)."""
    archive = parse_checkpoint(path, fh)
    host = Records(path, archive, fh.fileno(), verify)
    small = host.read(["data.pkl"], [])
    small.update(host.read([n for n in SMALL_RECORDS if n in archive.records], []))
    host.fd = -1
    if small.get("byteorder", sys.byteorder.encode()).decode("ascii", "replace") != sys.byteorder:
        return None
    return archive, small, DeviceRecords(path, archive, host, map_location)

