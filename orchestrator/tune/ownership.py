"""Who holds the study: its storage opened (created, or resumed under the same space), the sampler
each tuner process draws from, and what a tuner process that died left behind (its trials left
RUNNING, its MLflow runs) taken back. Mixed into study.Tuner (StudyOwnership), which gives it
`cfg`, `t`, `name`, `storage`, `space`, `multi`, `tracker`, `optuna` and `_say`."""

from __future__ import annotations

import time
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List

from ..schema import ConfigError, PrunerName, SamplerName
from ..stores import redact, sqlite_path, store_lock
from . import warm
from .answer import name_objectives, score_offset
from .edges import apply_extensions
from .goodput import global_batch, rule_of
from .rules import counted
from .space import NEEDS_WORKERS
from .storage import orphaned, study_lock, study_storage


class StudyOwnership:
    """The study's storage and what dead tuner processes left in it (see the module's docstring)."""

    def _study(self) -> Any:
        optuna = self.optuna
        if self.storage.startswith("sqlite:///"):
            Path(self.storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)  # interval: decided in _monitor
                  if self.t.pruner is PrunerName.median and not self.multi else optuna.pruners.NopPruner())
        # the store lock covers the first use of a fresh store (Optuna creates its tables)
        try:
            with store_lock(self.storage), study_lock(self.storage, self.name):
                study = self._create_or_load(pruner)
                name_objectives(study, self.t)
                self.offset = score_offset(study, self.t)  # 1 in a study made when the score was 1 + utilization
                self._check_space(study)
                worker = int(study.user_attrs.get("workers", 0))
                study.set_user_attr("workers", worker + 1)
                if "base_global_batch" not in study.user_attrs:  # M0: what goodput and the lr rule are relative to
                    study.set_user_attr("base_global_batch", global_batch(self.cfg))
                    study.set_user_attr("lr_scaling", rule_of(self.cfg).value)  # "none": goodput's worst case
                self._reclaim_orphans(study)
                apply_extensions(self.space, study.user_attrs.get("extended") or {})
                if self.t.baseline and (worker == 0 and not study.trials or self._baseline_interrupted(study)):
                    self._enqueue_baseline(study)
                self.warm = warm.start(study, self.cfg, self.storage, self.name, self.space, self.proposals,
                                       fresh=worker == 0 and not any(tr.user_attrs.get("warm_from") for tr in study.trials)
                                       and not counted(study.get_trials(deepcopy=False)), say=self._say)
        except ConfigError:
            raise
        except Exception as exc:  # unreachable host, wrong password, ...: before any trial
            raise ConfigError(f"tune.storage: cannot use {redact(self.storage)}: {first_line(exc)}") from None
        study.sampler = self._sampler(worker)
        return study

    def _check_space(self, study: Any) -> None:
        """A study keeps the tune.space it was made with (user attribute `space`, as given: caps
        that follow each machine's cores are not part of it): resuming it with another space is
        refused, in one line naming the dimensions that differ."""
        given = self._given_space()
        held = "free" if self.space.global_batch is None else self.space.global_batch
        if study.user_attrs.get("global_batch", held) != held:  # a study made before it was recorded: any
            raise ConfigError(f"tune.global_batch: study '{self.name}' was made with the global batch "
                              f"{study.user_attrs['global_batch']}, this call gives {held}; resume it with its own "
                              "tune.global_batch, or start another study (a new tune.study_name)")
        study.set_user_attr("global_batch", held)
        made = study.user_attrs.get("space")
        if made is None:  # a new study (or one made before the space was recorded)
            study.set_user_attr("space", given)
        elif made != given:
            differ = "; ".join(f"{n}: {made.get(n, 'absent')} -> {given.get(n, 'absent')}"
                               for n in sorted(set(made) | set(given)) if made.get(n) != given.get(n))
            raise ConfigError(f"tune.space: study '{self.name}' was made with another space ({differ}); resume it "
                              "with its own tune.space, or start another study (a new tune.study_name)")

    def _given_space(self) -> Dict[str, str]:
        return {name: " ".join(f"{k}={v.value if isinstance(v, Enum) else v}" for k, v in vars(spec).items())
                for name, spec in sorted(self.t.space.items())}

    def _baseline_interrupted(self, study: Any) -> bool:
        """The study's baseline trials were all interrupted (Ctrl-C, a killed tuner): a resumed
        study runs it again, so its summary has one."""
        base = [tr for tr in study.get_trials(deepcopy=False) if tr.user_attrs.get("baseline")]
        return bool(base) and all(tr.user_attrs.get("interrupted") for tr in base)

    def _enqueue_baseline(self, study: Any) -> None:
        """Trial 0: the config as given (its values outside the space are left to the sampler).
        A grid takes only whole points: knobs the baseline does not use (prefetch without workers)
        get the grid's first value; a baseline off the grid is not run, and the study says so."""
        params = self.space.params_of(self.space.baseline())
        if self.t.sampler is SamplerName.grid:
            grid = self.space.grid()
            missing = [d for d in self.space.dims if d.param not in params]
            if any(d.key not in NEEDS_WORKERS for d in missing):
                self._say("[tune] the config as given is not a point of the grid: no baseline trial ("
                          + ", ".join(f"{d.name}={self.space.baseline().get(d.key)}" for d in missing) + ")")
                return
            params.update({d.param: grid[d.param][0] for d in missing})
        study.enqueue_trial(params, user_attrs={"baseline": True})

    def _sampler(self, worker: int) -> Any:
        """tune.sampler, seeded: each tuner process of a shared study samples its own stream, the
        first one reproducible from tune.seed. guided is TPE; the diagnosis moves come on top
        (proposals.py)."""
        samplers, seed = self.optuna.samplers, self.t.seed + worker
        name = self.t.sampler
        if name is SamplerName.random:
            return samplers.RandomSampler(seed=seed)
        if name is SamplerName.grid:
            return grid_sampler(self.space.grid(), seed=seed)
        if name is SamplerName.gp:
            return samplers.GPSampler(seed=seed, n_startup_trials=self._startup_trials())
        with warnings.catch_warnings():  # group (conditional knobs such as prefetch_factor) is experimental
            warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
            return samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=self._startup_trials())

    def _startup_trials(self) -> int:
        return min(5, max(2, self.t.n_trials // 4))

    def _create_or_load(self, pruner: Any, attempts: int = 3) -> Any:
        """create_study(load_if_exists=True); on a server database another machine's tuner may be
        creating the schema or the study at the same moment: try again before giving up."""
        for attempt in range(attempts):
            try:
                return self.optuna.create_study(
                    study_name=self.name, storage=study_storage(self.storage), load_if_exists=True, pruner=pruner,
                    directions=["maximize", "maximize"] if self.multi else ["maximize"],
                )
            except ValueError as exc:  # e.g. resuming a single-objective study as multi-objective
                raise ConfigError(f"tune.study_name: cannot resume '{self.name}': {exc}") from None
            except Exception as exc:
                if attempt == attempts - 1:
                    raise ConfigError(f"tune.storage: cannot use {redact(self.storage)}: {first_line(exc)}") from None
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def _reclaim_orphans(self, study: Any) -> int:
        """Trials left RUNNING by a tuner process that died: see `reclaim_orphans`. Called under
        the study lock, before each count. Their MLflow runs are closed by _close_dead_runs."""
        return reclaim_orphans(study)

    def _close_dead_runs(self) -> None:
        """The MLflow runs of this study (a tuner's own run, its trials' and confirmations') left
        RUNNING by a tuner process that died: closed FAILED, with a note."""
        if "'" not in self.name:
            self.tracker.close_dead_runs(f"tags.study_name = '{self.name}'", f"study '{self.name}' was run again")

    def _finished_study(self) -> Any:
        """The named study, read without changing it, when it already has its trials and its
        confirmation under this space (a call with nothing to run returns at once); else None
        (the full path creates, checks or refuses it)."""
        db = sqlite_path(self.storage)
        if not self.t.study_name or (db is not None and not db.exists()):
            return None
        try:
            study = self.optuna.load_study(study_name=self.name, storage=study_storage(self.storage))
        except Exception:  # not there yet, or a store the full path reports on
            return None
        if study.user_attrs.get("space") != self._given_space() or self._confirmation_due(study):
            return None
        return study if counted(study.get_trials(deepcopy=False)) >= self.t.n_trials else None


def reclaim_orphans(study: Any) -> int:
    """Trials left RUNNING by a tuner process that died (killed, or its database went away
    mid-trial; see `storage.orphaned`) are recorded as interrupted: they neither count toward
    tune.n_trials nor hold a slot. Returns how many."""
    from optuna.trial import TrialState

    n = 0
    for tr in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if orphaned(tr):
            _mark_interrupted(study, tr)
            study.tell(tr.number, state=TrialState.FAIL)  # Optuna's tell takes any process's trial by number
            n += 1
    return n


def _mark_interrupted(study: Any, frozen: Any) -> None:
    """The user attribute `interrupted` on another process's RUNNING trial (a FrozenTrial)."""
    # Optuna has no public way to set a user attribute on a trial this process did not ask for
    study._storage.set_trial_user_attr(frozen._trial_id, "interrupted", True)


def grid_sampler(search_space: Dict[str, List[Any]], seed: int) -> Any:
    """Optuna's GridSampler for an ask-and-tell loop: it says when the grid is covered (the loop
    ends) instead of calling study.stop(), which only works inside study.optimize."""
    import optuna

    class Grid(optuna.samplers.GridSampler):
        covered = False

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.covered = self.is_exhausted(study)

    return Grid(search_space, seed=seed)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
