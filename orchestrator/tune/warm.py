"""What earlier studies of the same job carry over: a new study's warm start (tune.warm_start) and
a plain run's tuned config (trainer.tuned).

Every study records the fingerprint of its job (orchestrator/fingerprint.py) as the user attribute
`fingerprint`, and its pick's overrides (best.yaml's values, the learning rate included) as
`pick_values`, in its own Optuna storage: whoever can open the storage (any machine, any storage
the tuner supports) finds them, with nothing beside it.

An earlier study matches `full` (the same job, layout and hardware: its picks are this job's) or
`job` (the same model, data and optimizer at another world size or on another machine: its picks
are a place to start, its figures not this job's). `auto` takes the newest study with a pick,
full matches first.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional

from ..fingerprint import Fingerprint
from ..schema import ConfigError

FP_ATTR = "fingerprint"
VALUES_ATTR = "pick_values"
WARM_ATTR = "warm_start"  # a warm-started study's: where it started from (from, match, kept, enqueued)
SEEDS = 3  # an earlier study's best trials enqueued first: its pick, then the next best
MLFLOW_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class Earlier:
    """An earlier study of this job: its name, how it matches, when it started, its user attributes."""

    name: str
    match: str
    started: Optional[datetime]
    attrs: Dict[str, Any] = field(default_factory=dict)

    @property
    def pick_values(self) -> Optional[Dict[str, Any]]:
        values = self.attrs.get(VALUES_ATTR)
        return dict(values) if isinstance(values, dict) and values else None

    @property
    def pick_trial(self) -> Optional[int]:
        return self.attrs.get("pick_trial")

    def describe(self) -> str:
        how = "the same job, layout and hardware" if self.match == "full" else \
            "the same job at another world size or on another machine"
        return f"study '{self.name}' ({how}; its pick: trial {self.pick_trial})"


def fingerprint_of(attrs: Dict[str, Any]) -> Optional[Fingerprint]:
    f = attrs.get(FP_ATTR)
    try:
        return Fingerprint(**f) if isinstance(f, dict) else None
    except TypeError:  # a record of another shape: not comparable
        return None


def find(storage: Any, fp: Fingerprint, exclude: Optional[str] = None) -> List[Earlier]:
    """The studies in `storage` of `fp`'s job (full matches first, then newest first), but `exclude`."""
    import optuna

    found = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        other = fingerprint_of(s.user_attrs)
        if s.study_name == exclude or other is None or fp.matches(other) == "none":
            continue
        found.append(Earlier(s.study_name, fp.matches(other), s.datetime_start, dict(s.user_attrs)))
    return sorted(found, key=lambda e: (e.match != "full", -(e.started.timestamp() if e.started else 0.0)))


def choose(setting: str, found: List[Earlier], field_name: str = "tune.warm_start") -> Optional[Earlier]:
    """The earlier study `setting` names: `off` none; `auto` the first of `found` with a pick (None
    when there is none); a study name or the MLflow run id of a study's run: that study, which must
    be of this job (a ConfigError naming `field_name` otherwise)."""
    if setting == "off":
        return None
    with_pick = [e for e in found if e.pick_values]
    if setting == "auto":
        return with_pick[0] if with_pick else None
    by_run = MLFLOW_RUN_ID.match(setting)
    chosen = next((e for e in found if (e.attrs.get("mlflow_run_id") == setting if by_run else e.name == setting)),
                  None)
    if chosen is None:
        names = ", ".join(e.name for e in with_pick[:5]) or "none in this storage"
        raise ConfigError(f"{field_name}: no study {'with MLflow run' if by_run else 'named'} '{setting}' of this "
                          f"job (the same fingerprint's job part); allowed: auto, off, or one of: {names}")
    if not chosen.pick_values:
        raise ConfigError(f"{field_name}: study '{chosen.name}' has no pick yet (it ended before its first "
                          "measured trial, or before the product recorded picks); allowed: auto, off, or another study")
    return chosen


def seeds(storage: Any, earlier: Earlier, limit: int = SEEDS) -> List[Dict[str, Any]]:
    """The earlier study's best configs in user units, its pick first, then its other completed
    trials by value (each once)."""
    import optuna

    study = optuna.load_study(study_name=earlier.name, storage=storage)
    out: List[Dict[str, Any]] = []
    if earlier.pick_values:
        out.append(earlier.pick_values)
    done = [tr for tr in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if tr.user_attrs.get("values") and tr.values]
    for tr in sorted(done, key=lambda tr: -tr.values[0]):
        values = tr.user_attrs["values"]
        if len(out) >= limit:
            break
        if not any(_same(values, o) for o in out):
            out.append(dict(values))
    return out[:limit]


@dataclass
class Carried:
    """What a warm start takes from an earlier study: its measured trials and confirmed figures (a
    full match: the trials join the job model's fit, and its measurements of a config the new
    study measures again are pooled with the new study's, evidence.py), or its loader's per-item
    costs (a partial match: the job's loader is the same at another world size or on another
    machine; the rest of its figures are not this layout's), and what was kept, in words."""

    trials: List[Any] = field(default_factory=list)
    loader: Dict[str, float] = field(default_factory=dict)
    kept: str = ""
    source: str = ""  # the earlier study's name (a full match)
    confirmed: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # its confirmed figures (a full match)


def carry(storage: Any, earlier: Earlier) -> Carried:
    import optuna

    from ..jobmodel import JobModel, runs_of

    study = optuna.load_study(study_name=earlier.name, storage=storage)
    done = [tr for tr in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if tr.user_attrs.get("values")]
    if earlier.match == "full":
        return Carried(trials=done, source=earlier.name, confirmed=dict(study.user_attrs.get("confirmed") or {}),
                       kept=f"its {len(done)} measured trials join the job model, and its measurements of a config "
                            "measured again are pooled with this study's")
    world = int(study.user_attrs.get("world_size") or 1)
    model = JobModel.fit(runs_of(done, world), world)
    loader = {k: v for k, v in (("load_cpu", model.load_cpu if model else None),
                                ("load_wait", model.load_wait if model else None)) if v is not None}
    words = " and ".join(f"{k.replace('_', ' ')} {1e3 * v:.3f} ms/item" for k, v in loader.items())
    return Carried(loader=loader, kept=(f"the loader's per-item costs ({words}); not its other figures (another "
                                        "world size or machine)") if loader else "its picks only (no loader figures)")


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """The same point: equal on the keys both give."""
    return all(a[k] == b[k] for k in set(a) & set(b))


def tuned_values(storage: Any, fp: Fingerprint, setting: str) -> Optional[Earlier]:
    """trainer.tuned: the study whose pick a plain run applies (a full match only: the figures it
    was confirmed at are this job's on this machine); a ConfigError naming trainer.tuned when none."""
    full = [e for e in find(storage, fp) if e.match == "full"]
    chosen = choose(setting, full, "trainer.tuned")
    if chosen is None:
        raise ConfigError("trainer.tuned: no study of this job with a pick in tune.storage (none with the same "
                          f"fingerprint {fp.id}); tune it first (mode=tune), or set trainer.tuned=off")
    return chosen


def start(study: Any, cfg: Any, storage: Any, name: str, space: Any, proposals: Any, fresh: bool,
          say: Any) -> Optional[Dict[str, Any]]:
    """A study's warm start, in its storage lock: the fingerprint recorded (user attributes
    `fingerprint`, `world_size`); a fresh study with tune.warm_start not `off` finds the earlier
    study it names (auto: the newest of this job with a pick), enqueues that study's best configs
    after the baseline and lends the job model what carries over; a resumed one lends it again
    from the study it started from. Returns the `warm_start` record (None: a cold start)."""
    from ..fingerprint import fingerprint

    fp = fingerprint(cfg)
    if FP_ATTR not in study.user_attrs:
        study.set_user_attr(FP_ATTR, asdict(fp))
        study.set_user_attr("world_size", cfg.world_size)
    record = study.user_attrs.get(WARM_ATTR)
    if not fresh:
        if record:  # the study it started from, by the name and match it recorded
            try:
                _lend(proposals, carry(storage, Earlier(record["from"], record["match"], None)))
            except KeyError:  # deleted since: the trials this study measured stand alone
                pass
        return record
    earlier = choose(cfg.tune.warm_start, find(storage, fp, exclude=name))
    if earlier is None:
        return None
    carried = carry(storage, earlier)
    _lend(proposals, carried)
    queued = []
    old_world = int(earlier.attrs.get("world_size") or cfg.world_size)
    for values in seeds(storage, earlier):
        moved = at_world(values, old_world, cfg.world_size, carried.loader)
        hold(study, space, moved)
        params = space.params_of(moved)
        if params and params not in queued:
            study.enqueue_trial(params, user_attrs={"warm_from": earlier.name})
            queued.append(params)
    record = {"from": earlier.name, "match": earlier.match, "kept": carried.kept, "enqueued": len(queued)}
    study.set_user_attr(WARM_ATTR, record)
    say(f"[tune] warm start from {earlier.describe()}: its {len(queued)} best config(s) first; {carried.kept} "
        f"(tune.warm_start=off starts cold)")
    return record


def hold(study: Any, space: Any, values: Dict[str, Any]) -> None:
    """Widen this study's space so that it holds a carried config: an earlier study may have widened
    its own past the space's top (edges.py), and a config its space holds no value of would be
    enqueued with that dimension left to the sampler, i.e. as another config. Recorded as the
    study's `extended` widenings, which every tuner process of the study applies."""
    from .edges import apply_extensions

    before = dict(study.user_attrs.get("extended") or {})
    extended = dict(before)
    for dim in space.dims:
        value, tops = values.get(dim.key), [v for v in dim.extremes() if isinstance(v, (int, float))]
        if isinstance(value, (int, float)) and tops and not dim.contains(value) and value > max(tops):
            extended[dim.name] = max(value, extended.get(dim.name, value))
    if extended != before:
        study.set_user_attr("extended", extended)
        apply_extensions(space, extended)


def at_world(values: Dict[str, Any], old: int, new: int, loader: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """An earlier study's config moved from `old` ranks to `new` on the same machine kind, the
    per-rank batch kept. The machine's cores are shared by every rank's workers, so the part of a
    worker's time spent computing scales by old/new; the part spent waiting (storage, a network)
    needs as many workers a rank at any world size. `loader`, the job model's per-item costs
    (`load_cpu`, `load_wait`, seconds), weighs the two; without it the workers scale by old/new.
    At least 1 worker where it had some."""
    workers = values.get("data.num_workers")
    if old == new or not workers:
        return values
    cpu, wait = (loader or {}).get("load_cpu"), (loader or {}).get("load_wait")
    waiting = wait / (cpu + wait) if cpu is not None and wait is not None and cpu + wait > 0 else 0.0
    scale = (1 - waiting) * old / new + waiting
    return {**values, "data.num_workers": max(1, round(int(workers) * scale))}


def _lend(proposals: Any, carried: Carried) -> None:
    proposals.warm_trials, proposals.warm_loader, proposals.carried = carried.trials, carried.loader, carried


def apply_tuned(cfg: Any, say: Any) -> Any:
    """trainer.tuned on a plain run: `cfg` with the pick of the study it names (auto: the newest
    of this job, layout and machine in tune.storage) applied, tagged `tuned_study` (and
    `tuned_storage` where its URL holds no password) as the rerun of best.yaml is; `cfg` itself
    when it is off. A ConfigError naming trainer.tuned when no study matches."""
    import dataclasses

    from ..fingerprint import fingerprint
    from ..stores import PROJECT, redact, resolve_uri, sqlite_path
    from .space import apply

    if cfg.trainer.tuned == "off":
        return cfg
    storage = resolve_uri(cfg.tune.storage, PROJECT)
    fp = fingerprint(cfg)
    path = sqlite_path(storage)
    if path is not None and not path.exists():
        raise ConfigError(f"trainer.tuned: no study of this job in tune.storage ({redact(storage)} does not exist); "
                          "tune it first (mode=tune), or set trainer.tuned=off")
    earlier = tuned_values(storage, fp, cfg.trainer.tuned)
    values = earlier.pick_values or {}
    tuned = apply(cfg, values)
    tags = {**tuned.tags, "tuned_study": earlier.name, **({"tuned_storage": storage} if redact(storage) == storage else {})}
    say(f"[tuned] trainer.tuned={cfg.trainer.tuned}: the pick of {earlier.describe()} in {redact(storage)}: "
        + " ".join(f"{k}={v}" for k, v in values.items()))
    return dataclasses.replace(tuned, tags=tags)
