"""``fastckpt clean-memory``: the memory tier's namespaces of jobs that are gone, removed
(:func:`fastckpt.memory.stale.clean_report`), and what was kept and why."""

import os
from typing import Any, Dict, Optional

from .._core.units import human
from ..memory import stale
from .doctor import age_text


def clean_memory(root: str, older_than: Optional[float] = None, dry_run: bool = False,
                 force: bool = False) -> Dict[str, Any]:
    """What ``clean-memory --json`` prints: ``{"directory", "dry_run", "removed" (clean_report's
    entries), "kept" ([{"path", "why", "bytes", "newest_step", "directories"}]), "foreign"}``.
    A `root` that does not exist holds nothing."""
    out: Dict[str, Any] = {"directory": root, "dry_run": dry_run, "removed": [], "kept": [], "foreign": []}
    if not os.path.lexists(root):
        return out
    before = stale.scan(root)
    out["removed"] = stale.clean_report(root, older_than=older_than, dry_run=dry_run, force=force)
    done = {r["path"] for r in out["removed"]}
    for e in before:
        if e["kind"] == "foreign":
            out["foreign"].append({"path": e["path"], "why": e["why"]})
            continue
        if e["path"] in done:
            continue
        if stale.is_live(e, force):
            why = "live: " + ", ".join(f"pid {o['pid']}" + (f" on {o['host']}, which cannot be asked (--force "
                                                           "removes it)" if o["alive"] is None else " runs")
                                       for o in e["owners"] if o["alive"] is not False)
        elif older_than is not None and e["age"] < older_than:
            why = f"{age_text(e['age'])} old, newer than --older-than {older_than:g} s"
        else:
            why = "nothing of the memory tier's left in it; left alone: " + ", ".join(e["other_files"])
        out["kept"].append({"path": e["path"], "why": why, "bytes": e["bytes"], "newest_step": e["newest_step"],
                            "directories": e["directories"]})
    return out


def clean_memory_text(rep: Dict[str, Any]) -> str:
    L = []
    verb = "would remove" if rep["dry_run"] else "removed"
    for r in rep["removed"]:
        gone = r["path"] in r["removed"]
        step = "no complete snapshot" if r["newest_step"] is None else f"newest step {r['newest_step']}"
        L.append(f"{verb if gone else verb + ' the snapshots of'} {r['path']} ({human(r['bytes'])}, {step}, "
                 f"checkpoint directory {', '.join(r['directories']) or '?'})")
        L.extend(f"  left {item['path']}: {item['why']}" for item in r["left"])
    L.extend(f"kept {k['path']} ({k['why']})" for k in rep["kept"])
    L.extend(f"not ours, left alone: {f['path']} ({f['why']})" for f in rep["foreign"])
    if rep["removed"]:
        freed = sum(r["bytes"] for r in rep["removed"])
        L.append(f"{len(rep['removed'])} namespace(s), {human(freed)} "
                 f"{'would be freed' if rep['dry_run'] else 'freed'} in {rep['directory']}")
    elif os.path.lexists(rep["directory"]):
        L.append(f"nothing to clean in {rep['directory']}")
    else:
        L.append(f"{rep['directory']}: no memory directory, nothing to clean")
    return "\n".join(L)
