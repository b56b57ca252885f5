"""Where the tuner's next trials come from besides its sampler: proposals it enqueues into the
study (Optuna's `enqueue_trial`), each tagged `proposed_by` and a reason, within the budget.

- `model` (tune.sampler=guided): after every measured trial the job model (orchestrator/jobmodel.py)
  is fitted to all of them and the untried config with the highest predicted throughput (the top of
  its interval, so what was never measured gets its chance) is tried next, while that top lies
  above the best measured; a sampler's trial the model shows cannot reach the objective's floor
  of the fastest is not launched (`predicted_below`);
- `diagnosis`: for a trial that ran out of memory, half the batch with twice the accumulation
  (and with tune.sampler=guided and no model figures, the move a trial's diagnosis points to; a
  proposed trial proposes again while it beats the trial that proposed it);
- `edges` (tune.extend_edges): the best on the top of a dimension its verdict points past widens
  that dimension one step and is tried there (edges.py);
- `memory_ceiling` (screen.py): no batch as large as one that ran out of memory (at the same other
  knobs), or as one the trials' measured memory predicts over the limit (tune/memory.py), is
  launched at all.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..jobmodel import BASE_NOISE, Prediction
from ..schema import Config, Objective, SamplerName, TuneConfig
from .edges import apply_extensions, edges_of, next_step, workers_cap
from .goodput import efficiency, scale_of
from .rules import best_trials, counted, improves
from .screen import MODEL_KEYS, ModelScreen
from .space import ACCUM_KEY, BATCH_KEY, NEEDS_WORKERS, PREFETCH_KEY, WORKERS_KEY, SearchSpace
from .storage import study_lock

EDGE_GAIN = 0.05  # the least predicted gain that widens the workers past the space's top


class Proposals(ModelScreen):
    """The proposals a study enqueues (see the module's docstring); the job model's view of the
    study and what it rules out come from ModelScreen (screen.py)."""

    def __init__(self, space: SearchSpace, t: TuneConfig, storage: str, name: str, say: Callable[[str], None],
                 cfg: Optional[Config] = None) -> None:
        self.space, self.t, self.storage, self.name, self._say = space, t, storage, name, say
        self.cfg = cfg or space.base
        self.capped: Dict[str, str] = {}  # dimension -> why extend_edges did not widen it
        # a warm start (tune/warm.py): an earlier study's measured trials of this very job (they join
        # the job model's fit), or the loader's per-item costs of the same job elsewhere
        self.warm_trials: List[Any] = []
        self.warm_loader: Dict[str, float] = {}
        self.carried: Any = None  # what a warm start carried (warm.Carried): a full match's evidence is pooled

    # -- the job model's proposals -----------------------------------------------------------------
    def _candidates(self, study: Any, here: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every config of the space over batch, workers and accumulation (the other knobs as
        `here`), less those tried or queued, over a batch that ran out of memory, or training one
        step per epoch of the dataset (a different training: rules.refused)."""
        dims = {d.key: d for d in self.space.dims if d.key in MODEL_KEYS}
        if not dims or any(d.choices is None and d.type.value == "float" for d in dims.values()):
            return []
        trials = study.get_trials(deepcopy=False)
        seen = [tr.params or tr.system_attrs.get("fixed_params") or {} for tr in trials]
        ceiling = self.memory_ceiling(study, here)
        items = max([tr.user_attrs["steps_per_epoch"] * tr.user_attrs["values"].get(BATCH_KEY, 1)
                     * (tr.user_attrs["values"].get(ACCUM_KEY) or 1) for tr in trials
                     if tr.user_attrs.get("steps_per_epoch") and "values" in tr.user_attrs] + [0])
        out = []
        for combo in itertools.product(*(dims[k].values() for k in dims)):
            point = {**here, **dict(zip(dims, combo))}
            if ACCUM_KEY not in dims and self.space.global_batch:
                point[ACCUM_KEY] = self.space.global_batch // (self.space.world * int(point[BATCH_KEY]))
            b, a = int(point.get(BATCH_KEY) or self.cfg.data.batch_size), int(point.get(ACCUM_KEY) or 1)
            if ceiling is not None and b >= ceiling[0]:
                continue
            if items and not self.t.allow_large_global_batch and items // (b * a) <= 1:
                continue
            point = self._with_queue(point, here)
            if not all(self.space.contains(k, v) for k, v in point.items() if k in self.space.keys):
                continue
            if self.space.params_of(point) in seen:
                continue
            out.append(point)
        return out

    def _with_queue(self, point: Dict[str, Any], here: Dict[str, Any]) -> Dict[str, Any]:
        if point.get(WORKERS_KEY) == 0:
            return {k: v for k, v in point.items() if k not in NEEDS_WORKERS}
        if PREFETCH_KEY in self.space.keys and point.get(PREFETCH_KEY) is None:
            return {**point, PREFETCH_KEY: here.get(PREFETCH_KEY) or 2}  # torch's default queue depth
        return point

    @staticmethod
    def _worker_cost(point: Dict[str, Any]) -> float:
        """1% less per loader worker: where the model predicts no difference (a loader it measured
        as free), fewer processes competing with the training process for the cores come first."""
        return 1.0 - 0.01 * int(point.get(WORKERS_KEY) or 0)

    def _next(self, preds: List[Tuple[Prediction, Dict[str, Any]]],
              done: List[Dict[str, Any]]) -> Optional[Tuple[Prediction, Dict[str, Any], str]]:
        """The config to measure next, with why: first the fastest that may be (the highest top of
        its predicted throughput, while that top lies above the best measured throughput; under the
        utilization objective the busiest of those within BASE_NOISE of that top); then,
        under the utilization objective, among the configs predicted to keep up with the floor of
        the best throughput, the one whose predicted utilization may beat that of the trials that
        keep up (a smaller batch that moves as many samples keeps the device busier)."""
        if not preds:
            return None
        best = max((f["throughput"] for f in done), default=0.0)
        top = max(preds, key=lambda x: (x[0].hi * self._worker_cost(x[1]), x[0].throughput))
        pred, point = top
        if self.t.objective is Objective.utilization:
            # configs as promising on throughput as the top (within the least noise of a prediction):
            # the busiest first: by the highest throughput bound alone a study's last trial can
            # go to a config barely faster and much less busy than the one it would pick
            reach = (1 - BASE_NOISE) * top[0].hi * self._worker_cost(top[1])
            near = [x for x in preds if x[0].hi * self._worker_cost(x[1]) >= reach]
            pred, point = max(near, key=lambda x: (x[0].utilization or 0.0, x[0].hi))
        if pred.hi > best:
            return pred, point, f"vs the best measured {best:.0f}/s"
        if self.t.objective is not Objective.utilization:
            return None
        floor = self.t.throughput_floor * best
        busiest = max((f["utilization"] for f in done if f["throughput"] >= floor), default=0.0)
        keep_up = [(p, pt) for p, pt in preds if p.utilization is not None and p.hi >= floor]
        if not keep_up:
            return None
        pred, point = max(keep_up, key=lambda x: (x[0].utilization * (1 + 2 * x[0].rel_unc), x[0].throughput))
        if pred.utilization * (1 + 2 * pred.rel_unc) <= busiest:
            return None
        return pred, point, (f"within {self.t.throughput_floor:g} of the best measured {best:.0f}/s, with utilization "
                             f"{100 * pred.utilization:.0f}% vs {100 * busiest:.0f}% among the trials that keep up")

    def model(self, study: Any, trial: Any, values: Dict[str, Any]) -> bool:
        """tune.sampler=guided: enqueue the untried config whose predicted throughput has the
        highest top of its interval, when that top lies above the best measured throughput (the
        config may beat it); True when one was queued."""
        if self.t.sampler is not SamplerName.guided or self.t.objective is Objective.both:
            return False
        if self._others(values) and trial.user_attrs.get("proposed_by") == "model":
            return False  # knobs it does not model (a backend, fp16): every other trial is the sampler's
        model = self.job_model(study, values)
        if model is None:
            return False
        here = {d.key: values[d.key] for d in self.space.dims if values.get(d.key) is not None}
        with study_lock(self.storage, self.name):
            trials = study.get_trials(deepcopy=False)
            if not self._budget_left(trials):
                return False
            candidates = self._candidates(study, here)
            if not candidates:
                return False
            preds = [(self.predict(model, p, study), p) for p in candidates]
            done = [tr.user_attrs for tr in trials if tr.state.name == "COMPLETE"
                    and "throughput" in tr.user_attrs and "utilization" in tr.user_attrs]
            if self.t.objective is Objective.tokens:  # the best real tokens/s, in this data's samples/s
                per = self.tokens_per_sample(study, values)
                if per is None:
                    return False
                done = [{**f, "throughput": f["tokens_per_s"] / per} for f in done if f.get("tokens_per_s") is not None]
            if self.t.objective is Objective.goodput:  # the best goodput (at the study's noise scale now), against predicted goodput
                m0, b = scale_of(study)
                done = [{**f, "throughput": f["throughput"] * efficiency(f.get("global_batch") or m0, m0, b)}
                        for f in done] if m0 else []
            pick = self._next(preds, done)
            if pick is None:
                return False
            pred, point, why = pick
            knobs = " ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items() if k in MODEL_KEYS)
            reason = (f"the job model predicts {pred.throughput:.0f}/s (up to {pred.hi:.0f}; {pred.bound}-bound) at "
                      f"{knobs}, {why}; it rests on {model.explain()}")
            study.enqueue_trial(self.space.params_of(point), user_attrs={"proposed_by": "model", "reason": reason[:480],
                                                                         "parent": trial.number,
                                                                         "predicted": pred.throughput})
        self._say(f"[tune] after trial {trial.number}: {reason}")
        return True

    def _budget_left(self, trials: Any) -> bool:
        """A queued proposal must be run by someone: the counted and waiting trials stay within
        tune.n_trials (called under the study lock)."""
        waiting = sum(tr.state.name == "WAITING" for tr in trials)
        return counted(trials) + waiting < self.t.n_trials

    def _more_workers(self, study: Any, best: Any, step: Dict[str, Any]) -> Dict[str, Any]:
        """The workers edge as the job model sees it: `step` when the model fitted to the study
        predicts the best's config faster with step's workers (by more than EDGE_GAIN), else why
        not ({"capped": ...}). An input-bound verdict says the step waits for data, not that more
        workers bring it: workers that compute share the cores with the training process, and past
        them they only take its time (with a CPU-heavy transform on 2 cores, 6 and 8 workers make
        each step slower)."""
        values = best.user_attrs["values"]
        model = self.job_model(study, values) if self.t.sampler is SamplerName.guided else None
        if model is None:
            return step
        now, more = self.predict(model, values), self.predict(model, {**values, WORKERS_KEY: step["value"]})
        if more.throughput > (1 + EDGE_GAIN) * now.throughput:
            return step
        return {"capped": (f"the job model predicts {more.throughput:.0f}/s with {step['value']} workers against "
                           f"{now.throughput:.0f}/s with {values.get(WORKERS_KEY)} ({now.bound}-bound: {model.explain()})")}

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
        past: widen the dimension one step (edges.next_step: up to edges.workers_cap, memory,
        the dataset) for every tuner process of the study, and try the best there next (a trial
        proposed by `edge`). Once per step: a dimension already widened past the best is left alone."""
        best = best_trials(study, self.t)
        if not best or best[0].number != last.number:  # only a new best opens an edge
            return
        for edge in edges_of(best[0], self.space):
            dim = next(d for d in self.space.dims if d.name == edge.name)
            step = next_step(dim, best[0], study.get_trials(deepcopy=False), workers_cap(self.space))
            if "capped" not in step and edge.key == WORKERS_KEY:
                step = self._more_workers(study, best[0], step)
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
