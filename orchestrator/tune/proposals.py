"""Where the tuner's next trials come from besides its sampler: proposals it enqueues into the
study (Optuna's `enqueue_trial`), each tagged `proposed_by` and a reason, within the budget.

- `diagnosis` (tune.sampler=guided): the move a completed trial's diagnosis points to, or for a
  trial that ran out of memory half the batch with twice the accumulation; a proposed trial
  proposes again while it beats the trial that proposed it (a chain that climbs);
- `edges` (tune.extend_edges): the best on the top of a dimension its verdict points past widens
  that dimension one step and is tried there (edges.py);
- `memory_ceiling`: no batch larger than one that ran out of memory is launched at all.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ..schema import SamplerName, TuneConfig
from .edges import apply_extensions, edges_of, next_step, workers_cap
from .rules import best_trials, counted, improves, out_of_memory
from .space import BATCH_KEY, NEEDS_WORKERS, PREFETCH_KEY, WORKERS_KEY, SearchSpace
from .storage import study_lock


class Proposals:
    def __init__(self, space: SearchSpace, t: TuneConfig, storage: str, name: str, say: Callable[[str], None]) -> None:
        self.space, self.t, self.storage, self.name, self._say = space, t, storage, name, say
        self.capped: Dict[str, str] = {}  # dimension -> why extend_edges did not widen it

    def _budget_left(self, trials: Any) -> bool:
        """A queued proposal must be run by someone: the counted and waiting trials stay within
        tune.n_trials (called under the study lock)."""
        waiting = sum(tr.state.name == "WAITING" for tr in trials)
        return counted(trials) + waiting < self.t.n_trials

    def memory_ceiling(self, study: Any) -> Optional[Tuple[int, int]]:
        """(batch, trial): the smallest batch that ran out of memory (or was memory-bound) so far
        at this world size; no larger batch is launched for the rest of the study."""
        bad = [(tr.user_attrs["values"][BATCH_KEY], tr.number) for tr in study.get_trials(deepcopy=False)
               if BATCH_KEY in (tr.user_attrs.get("values") or {}) and out_of_memory(tr)]
        return min(bad) if bad else None

    def diagnosis(self, study: Any, trial: Any, values: Dict[str, Any], diagnosis: Dict[str, Any]) -> None:
        """tune.sampler=guided: enqueue the neighbour this trial's diagnosis points to, its first
        move that stays in the space and has not been tried. A proposed trial proposes again only
        while it climbs: when it beat the trial that proposed it by more than that trial's noise
        (rules.improves), or ran out of memory. So a chain of moves follows the diagnosis as far as
        it pays (a compute-bound batch 16 -> 32 -> 64), ends at the first move that does not, and
        the sampler's own trials, each of which may start a chain, keep the search exploring."""
        if self.t.sampler is not SamplerName.guided:
            return
        if trial.user_attrs.get("proposed_by") == "diagnosis" and not self._climbing(study, trial, diagnosis):
            return
        here = {d.key: values[d.key] for d in self.space.dims if values.get(d.key) is not None}
        with study_lock(self.storage, self.name):  # the budget: a queued proposal must be run by someone
            trials = study.get_trials(deepcopy=False)
            if not self._budget_left(trials):
                return
            seen = [tr.params or tr.system_attrs.get("fixed_params") or {} for tr in trials]
            for move in diagnosis.get("moves", []):
                changes = {k: self.space.snap(k, here.get(k), v) for k, v in move["set"].items() if k in self.space.keys}
                changes = {k: v for k, v in changes.items() if v is not None}
                point = {**here, **changes}
                if point.get(WORKERS_KEY) == 0:  # knobs of the workers' queue go with the workers
                    point = {k: v for k, v in point.items() if k not in NEEDS_WORKERS}
                elif PREFETCH_KEY in self.space.keys and PREFETCH_KEY not in point:
                    point[PREFETCH_KEY] = 2  # first workers: torch's default queue depth
                if not changes or point == here or not all(self.space.contains(k, v) for k, v in point.items()):
                    continue
                params = self.space.params_of(point)
                if params in seen:
                    continue
                reason = f"trial {trial.number} is {diagnosis['verdict']}: {move['why']}"
                study.enqueue_trial(params, user_attrs={"proposed_by": "diagnosis", "reason": reason[:480],
                                                        "parent": trial.number})
                self._say(f"[tune] trial {trial.number} is {diagnosis['verdict']}: proposes "
                          + " ".join(f"{k.split('.')[-1]}={v}" for k, v in changes.items()))
                return

    def _climbing(self, study: Any, trial: Any, diagnosis: Dict[str, Any]) -> bool:
        """A proposed trial that beat its proposer beyond the noise, or ran out of memory."""
        if diagnosis.get("verdict") == "out of memory":
            return True
        number = trial.user_attrs.get("parent")
        if number is None:
            return False
        parent = next((tr for tr in study.get_trials(deepcopy=False) if tr.number == number), None)
        if parent is None:
            return False
        mine, theirs = trial.user_attrs, parent.user_attrs
        if parent.state.name != "COMPLETE" or "throughput" not in theirs or "throughput" not in mine:
            return False
        return improves(mine, theirs, self.t)

    def edges(self, study: Any, last: Any) -> None:
        """tune.extend_edges: the best so far sits on the top of a dimension its verdict points
        past: widen the dimension one step (edges.next_step: up to tune.max_workers_cap, memory,
        the dataset) for every tuner process of the study, and try the best there next (a trial
        proposed by `edge`). Once per step: a dimension already widened past the best is left alone."""
        best = best_trials(study, self.t)
        if not best or best[0].number != last.number:  # only a new best opens an edge
            return
        for edge in edges_of(best[0], self.space):
            dim = next(d for d in self.space.dims if d.name == edge.name)
            step = next_step(dim, best[0], study.get_trials(deepcopy=False), workers_cap(self.space, self.t.max_workers_cap))
            if "capped" in step:
                self.capped[edge.name] = step["capped"]
                continue
            with study_lock(self.storage, self.name):
                extended = dict(study.user_attrs.get("extended") or {})
                if not self._budget_left(study.get_trials(deepcopy=False)) or extended.get(edge.name, 0) >= step["value"]:
                    return
                extended[edge.name] = step["value"]
                study.set_user_attr("extended", extended)
                apply_extensions(self.space, extended)
                point = {**best[0].user_attrs["values"], edge.key: step["value"]}
                reason = f"trial {best[0].number} is {edge.verdict} at {edge.name}={edge.value}, the top of the space"
                study.enqueue_trial(self.space.params_of(point), user_attrs={"proposed_by": "edge", "reason": reason})
            self._say(f"[tune] {reason}: widened {edge.name} to {dim.describe()}, trying {edge.name}={step['value']}")
