"""Edges of the space: a best trial that sits on the boundary of a dimension while its verdict
points past it (input-bound with the most workers the space allows, compute-bound at its largest
batch, communication-bound at its most accumulation) says the optimum may lie outside the space.
The study says so, and with tune.extend_edges widens that dimension one step at a time, up to a
hard cap, and tries the step (Tuner._extend_edges).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .rules import out_of_memory
from .space import ACCUM_KEY, BATCH_KEY, WORKERS_KEY, Dimension, SearchSpace

# verdict -> the knob its advice raises
PAST_THE_EDGE = {"input-bound": WORKERS_KEY, "compute-bound": BATCH_KEY, "communication-bound": ACCUM_KEY}
MAX_ACCUMULATION = 64
MIN_STEPS_PER_EPOCH = 4  # a larger batch is tried only while the best trains >= this many steps per epoch


@dataclass
class Edge:
    name: str  # the dimension
    key: str
    value: Any  # the best trial's value, the top of the dimension
    verdict: str
    best: int  # the trial

    def describe(self, dim: Dimension) -> str:
        return (f"trial {self.best} is {self.verdict} at {self.name}={self.value}, the top of {dim.describe()}: "
                f"the optimum may lie past the edge of the space")


def edges_of(trial: Any, space: SearchSpace) -> List[Edge]:
    """The dimensions the trial's verdict points past while it sits on their top."""
    verdict = trial.user_attrs.get("verdict")
    key = PAST_THE_EDGE.get(verdict or "")
    dim = next((d for d in space.dims if d.key == key), None)
    value = (trial.user_attrs.get("values") or {}).get(key)
    if dim is None or value is None or value != max(dim.extremes()) or min(dim.extremes()) == value:
        return []  # not on the top, or a single value: the user fixed it
    return [Edge(dim.name, key, value, verdict, trial.number)]


def next_step(dim: Dimension, trial: Any, study_trials: List[Any], workers_cap: int) -> Dict[str, Any]:
    """The dimension's next value past its top, or why there is none: {"value": v} or {"capped": why}."""
    top = max(dim.extremes())
    if dim.key == WORKERS_KEY:
        value = top + max(1, top // 2)
        if top >= workers_cap:
            return {"capped": f"data.num_workers={workers_cap} is the most a study tries (4 x the CPU cores of a rank)"}
        return {"value": min(value, workers_cap)}
    if dim.key == BATCH_KEY:
        per_epoch = trial.user_attrs.get("steps_per_epoch")
        if per_epoch is not None and per_epoch < MIN_STEPS_PER_EPOCH:
            return {"capped": f"the dataset: trial {trial.number} already trains {per_epoch} steps per epoch"}
        failed = [tr for tr in study_trials if (tr.user_attrs.get("values") or {}).get(BATCH_KEY, 0) > top
                  and out_of_memory(tr)]
        if failed:
            return {"capped": f"memory: trial {failed[0].number} ran out at a larger batch"}
        return {"value": 2 * top}
    if dim.key == ACCUM_KEY:
        if top >= MAX_ACCUMULATION:
            return {"capped": f"accumulation {MAX_ACCUMULATION}"}
        return {"value": min(2 * top, MAX_ACCUMULATION)}
    return {"capped": "not a dimension the study widens"}


def widen(dim: Dimension, value: Any) -> None:
    """Make `value` the dimension's new top (choices gain it; a range's high moves)."""
    if dim.choices is not None:
        if value not in dim.choices:
            dim.choices = sorted([*dim.choices, value])
    else:
        dim.high = value


def apply_extensions(space: SearchSpace, extended: Dict[str, Any]) -> None:
    """The widenings a study recorded (its `extended` user attribute), applied to a fresh space:
    every tuner process of the study, and a resumed one, searches the same space."""
    for dim in space.dims:
        if dim.name in extended and extended[dim.name] > max(dim.extremes()):
            widen(dim, extended[dim.name])


def summary_of(best: Any, space: SearchSpace, extended: Dict[str, Any], capped: Dict[str, str]) -> List[Dict[str, Any]]:
    """summary.json's `edges`: where the final best sits on an edge its verdict points past."""
    out = []
    for e in edges_of(best, space):
        dim = next(d for d in space.dims if d.name == e.name)
        out.append({"dimension": e.name, "key": e.key, "value": e.value, "verdict": e.verdict, "trial": e.best,
                    "space": dim.describe(), "extended": e.name in extended, "capped": capped.get(e.name),
                    "note": e.describe(dim)})
    return out


def advice(edge: Dict[str, Any], extend: bool) -> str:
    """The console line for an edge of the final best."""
    if edge.get("capped"):
        return f"{edge['note']}; not widened further: {edge['capped']}"
    if not extend:
        return f"{edge['note']}; widen it (tune.space.{edge['dimension']}.high) or set tune.extend_edges=true"
    return f"{edge['note']}; tune.n_trials ran out before a wider step was tried: raise it to search past it"


def workers_cap(space: SearchSpace, cpu_count: Optional[int] = None) -> int:
    """How far extend_edges may take data.num_workers: 4 x CPU cores per local rank (workers that
    wait on storage pay beyond the cores; twice tune.max_workers' default)."""
    from .space import default_max_workers

    return 2 * default_max_workers(space.base, cpu_count)
