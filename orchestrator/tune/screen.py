"""The job model's view of a study (orchestrator/jobmodel.py fitted to its measured trials): its
predictions at a config, and the configs it rules out before a launch: a sampler's config whose
predicted top lies below the objective's floor of the fastest trial (`cannot_win`), a batch
known not to fit (`memory_ceiling`). The base of proposals.Proposals, which gives it `space`, `t`
and `cfg`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Tuple

from ..jobmodel import JobModel, Prediction, runs_of
from ..schema import Objective, SamplerName
from .goodput import efficiency, study_b
from .memory import first_over
from .rules import out_of_memory
from .space import ACCUM_KEY, BATCH_KEY, NEEDS_WORKERS, WORKERS_KEY

MODEL_KEYS = (BATCH_KEY, WORKERS_KEY, ACCUM_KEY)  # the knobs the job model models


class ModelScreen:
    """The job model's fit, predictions and the configs it rules out (see the module's docstring)."""

    def _others(self, values: Dict[str, Any]) -> tuple:
        """The values of the knobs the job model does not model (a model's args, a backend, fp16
        compression): it predicts only among trials that share them."""
        return tuple((d.key, values.get(d.key)) for d in self.space.dims
                     if d.key not in MODEL_KEYS and d.key not in NEEDS_WORKERS and d.key != "data.pin_memory")

    def job_model(self, study: Any, values: Dict[str, Any]) -> Optional[JobModel]:
        """The job model fitted to the study's measured trials that share `values`' other knobs
        (None before the first)."""
        from ..costs import handoff_s

        mine = self._others(values)
        trials = [tr for tr in [*self.warm_trials, *study.get_trials(deepcopy=False)]
                  if self._others(tr.user_attrs.get("values") or {}) == mine]
        runs = runs_of(trials, self.cfg.world_size)
        if not runs:
            return None
        last = next((tr.user_attrs["input_cost"] for tr in reversed(trials) if tr.user_attrs.get("input_cost")), {})
        item = next((tr.user_attrs["item_bytes"] for tr in trials if tr.user_attrs.get("item_bytes")), 0)
        # once per batch size: every candidate asks, and costs.py reads its cache file each time
        hand = functools.lru_cache(maxsize=None)(lambda b: handoff_s(int(item) * b, b)["seconds"]) if item else None
        return JobModel.fit(runs, self.cfg.world_size, cores=float(last.get("cores") or 1),
                            threads=float(last.get("threads") or 1), handoff=hand, loader_prior=self.warm_loader)

    def predict(self, model: JobModel, point: Dict[str, Any], study: Any = None) -> Prediction:
        """The job model's samples/s at `point`; under the goodput objective (given the `study`,
        whose noise scale it uses) its goodput: samples/s x the efficiency of its global batch."""
        b = int(point.get(BATCH_KEY) or self.cfg.data.batch_size)
        a = int(point.get(ACCUM_KEY) or self.cfg.trainer.accumulation_steps)
        w = int(point.get(WORKERS_KEY) if point.get(WORKERS_KEY) is not None else self.cfg.data.num_workers)
        pred = model.predict(b, w, a)
        if study is None or self.t.objective is not Objective.goodput:
            return pred
        world, m0 = self.space.world, self.cfg.data.batch_size * self.cfg.trainer.accumulation_steps * self.space.world
        return dataclasses.replace(pred, throughput=pred.throughput * efficiency(b * a * world, m0, study_b(study)))

    def cannot_win(self, study: Any, values: Dict[str, Any]) -> Optional[str]:
        """Why a sampler's config is not worth a launch: the top of its predicted throughput lies
        below the objective's floor of the fastest trial's measured interval (under the
        utilization objective a trial below that floor ranks under every trial that keeps up)."""
        if self.t.sampler is not SamplerName.guided or self.t.objective is Objective.both:
            return None
        model = self.job_model(study, values)
        done = [tr for tr in study.get_trials(deepcopy=False) if tr.state.name == "COMPLETE" and "throughput" in tr.user_attrs]
        if model is None or not done or BATCH_KEY not in values:
            return None
        if self.t.objective is Objective.tokens:
            return self._cannot_win_tokens(study, model, values, done)
        name = "goodput" if self.t.objective is Objective.goodput else "throughput"
        done = [tr for tr in done if tr.user_attrs.get(name) is not None]
        if not done:
            return None
        fastest = max(done, key=lambda tr: tr.user_attrs[name])
        lo = fastest.user_attrs.get(f"{name}_lo") or fastest.user_attrs[name]
        floor = self.t.throughput_floor if self.t.objective is Objective.utilization else 1.0
        pred = self.predict(model, values, study)
        if pred.hi >= floor * lo:
            return None
        return (f"predicted {pred.throughput:.0f}/s (at most {pred.hi:.0f}; {pred.bound}-bound: {model.explain()}), "
                f"below {floor:g} x trial {fastest.number}'s measured {lo:.0f}/s")

    def tokens_per_sample(self, study: Any, values: Dict[str, Any]) -> Optional[float]:
        """Real tokens a sample holds, measured over the trials that share `values`' other knobs
        (the data is theirs: batch, workers and accumulation change how fast samples go, not the
        tokens in one). The job model predicts samples/s; times this, real tokens/s."""
        mine = self._others(values)
        rates = [tr.user_attrs["tokens_per_s"] / tr.user_attrs["throughput"] for tr in study.get_trials(deepcopy=False)
                 if tr.state.name == "COMPLETE" and tr.user_attrs.get("tokens_per_s") and tr.user_attrs.get("throughput")
                 and self._others(tr.user_attrs.get("values") or {}) == mine]
        return sum(rates) / len(rates) if rates else None

    def _cannot_win_tokens(self, study: Any, model: JobModel, values: Dict[str, Any], done: List[Any]) -> Optional[str]:
        """tune.objective=tokens: the top of the predicted samples/s times the real tokens a sample
        of this data holds lies below the low end of the most real tokens/s measured."""
        per = self.tokens_per_sample(study, values)
        done = [tr for tr in done if tr.user_attrs.get("tokens_per_s") is not None]
        if per is None or not done:
            return None
        best = max(done, key=lambda tr: tr.user_attrs["tokens_per_s"])
        lo = best.user_attrs.get("tokens_per_s_lo") or best.user_attrs["tokens_per_s"]
        pred = self.predict(model, values)
        if per * pred.hi >= lo:
            return None
        return (f"predicted {per * pred.throughput:.0f} real tokens/s ({pred.throughput:.0f} samples/s x {per:.1f} tokens "
                f"a sample; at most {per * pred.hi:.0f}; {pred.bound}-bound: {model.explain()}), below trial "
                f"{best.number}'s measured {lo:.0f}")

    def memory_ceiling(self, study: Any, values: Dict[str, Any]) -> Optional[Tuple[int, int, str]]:
        """(batch, trial, why): the smallest batch known not to fit so far at `values`' other knobs
        (a memory cap, amp, a backend or a model's size change what fits; workers and accumulation
        do not change a micro-batch's activations): one that ran out of memory, the next above
        one that was memory-bound (it ran, at the edge), or the first that the trials' measured
        memory, grown with the batch, puts over the limit (tune/memory.py; `trial`: the largest
        batch measured). No batch from it up is launched for the rest of the study."""
        bad, mine, fitted = [], self._others(values), []
        for tr in study.get_trials(deepcopy=False):
            b = (tr.user_attrs.get("values") or {}).get(BATCH_KEY)
            if b is None or self._others(tr.user_attrs["values"]) != mine:
                continue
            if tr.state.name == "COMPLETE" and tr.user_attrs.get("memory"):
                fitted.append((int(b), tr.user_attrs["memory"], tr.number))
            if not out_of_memory(tr):
                continue
            ran_out = str(tr.user_attrs.get("error", "")).startswith("out of memory")
            bad.append((b if ran_out else b + 1, tr.number,
                        f"trial {tr.number} {'ran out of memory' if ran_out else 'was memory-bound'} at batch {b}"))
        over = first_over([(b, m) for b, m, _ in fitted])
        if over is not None:  # the memory the trials measured, grown with the batch (tune/memory.py)
            bad.append((over[0], max(fitted, key=lambda f: f[0])[2], over[1]))
        return min(bad) if bad else None
