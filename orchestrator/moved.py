"""Keys the schema no longer has under their old names, and where each went: the one line a user
gets who gives an old key (on the command line, in an experiment file), and the records written
before (a run's config.yaml, read again by a resume) read with the new names."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

_MEASURE = ("warmup_steps", "window_steps", "window_s", "rel_precision", "min_measure_s", "max_measure_s")
_SIM = ("read_latency_ms", "latency_jump_at", "latency_after_ms")

# old dotted key -> its key now
MOVED: Dict[str, str] = {
    **{f"trainer.{k}": f"measure.{k}" for k in (*_MEASURE, "profile_steps", "peak_tflops", "noise_scale", "noise_every")},
    **{f"tune.{k}": f"measure.{k}" for k in _MEASURE},
    "tune.measure_steps": "measure.trial_steps",
    **{f"data.{k}": f"sim.{k}" for k in _SIM},
}

# old dotted key -> what holds its value now: no longer a setting
RETIRED: Dict[str, str] = {
    "tune.max_workers_cap": "a study widens data.num_workers up to 4 x the CPU cores of a rank "
                            "(orchestrator/tune/edges.py, workers_cap); tune.extend_edges=false keeps tune.max_workers",
    "parallelism.balance_tolerance": "balance=speed re-balances beyond a 10% change of a share "
                                     "(orchestrator/runtime/balance.py, TOLERANCE)",
}


def moved_line(key: str, value: Optional[str] = None) -> Optional[str]:
    """The one line for an old `key` (given `value`, when known); None for any other key."""
    key = key.lstrip("+~")
    if key in MOVED:
        new = MOVED[key]
        return f"{key}: moved to {new}; write {new}={value}" if value is not None else f"{key}: moved to {new}"
    if key in RETIRED:
        return f"{key}: no longer a setting: {RETIRED[key]}"
    return None


def moved_override(argv: List[str]) -> Optional[str]:
    """The line for the first command-line override that names an old key; None when none does."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        line = moved_line(key, value)
        if line:
            return line
    return None


def migrate(record: Dict[str, Any]) -> Dict[str, Any]:
    """A config written before the moves (plain containers), with the new names: a study's tune.*
    measurement settings, a run's trainer.* (both were written; the mode's were the ones used);
    retired keys dropped. A record with the new names comes back as it is."""
    if not any(_has(record, key) for key in (*MOVED, *RETIRED)):
        return record
    out = copy.deepcopy(record)
    study = out.get("mode") == "tune"
    for old, new in MOVED.items():
        if not _has(out, old):
            continue
        value = _pop(out, old)
        used = not old.startswith(("trainer.", "tune.")) or new.split(".", 1)[1] not in _MEASURE or (
            old.startswith("tune.") == study)
        if used:
            out.setdefault(new.split(".", 1)[0], {})[new.split(".", 1)[1]] = value
    for old in RETIRED:
        if _has(out, old):
            _pop(out, old)
    return out


def _has(record: Dict[str, Any], key: str) -> bool:
    section, _, name = key.partition(".")
    return isinstance(record.get(section), dict) and name in record[section]


def _pop(record: Dict[str, Any], key: str) -> Any:
    section, _, name = key.partition(".")
    return record[section].pop(name)
