"""What the study says to the readers of Optuna's own records (`optuna.load_study`,
`study.best_trial`, optuna-dashboard): its objectives named in their units, each trial's knobs in
user units beside the sampler's internal parameters, and the product's pick as study attributes.

Optuna's `best_trial` is the highest value told during the study; a utilization trial's value was
scored against the best throughput seen when it ended, and the pick is made afterwards from the
confirmation runs (rules.best_trials), so the two may differ. The study attribute `pick` is the
answer (its trial, its confirmed figures, its config); `pick_note` says so in a line wherever
Optuna's best disagrees. optuna-dashboard, where installed, shows the same in its notes: the study's
note names the pick and why its "Best Trial" is another trial, the pick's trial note says it is the
pick."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

from ..schema import Objective, TuneConfig
from .goodput import LR_KEY as LR
from .rules import confirmed, figures
from .space import ACCUM_KEY as ACCUM
from .space import BATCH_KEY as BATCH
from .space import WORKERS_KEY as WORKERS

# Optuna's metric names, one per objective value (the value's unit)
METRIC_NAMES = {
    Objective.utilization: ["utilization (below the throughput floor: minus the share of samples/s lost)"],
    Objective.throughput: ["samples/s"],
    Objective.mfu: ["mfu"],
    Objective.tokens: ["real tokens/s"],
    Objective.goodput: ["goodput (samples/s x each sample's worth at the user's global batch)"],
    Objective.both: ["utilization", "samples/s"],
}
PICK_FIGURES = ("utilization", "utilization_lo", "utilization_hi", "throughput", "throughput_lo", "throughput_hi",
                "mfu", "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi", "goodput", "efficiency", "lr", "runs")


OLD_UTILIZATION_NAME = "1 + utilization within the throughput floor, samples/s over the best's below it"


def score_offset(study: Any, t: TuneConfig) -> float:
    """What the utilization objective adds to its score (rules.utilization_score) in this study:
    0, except in a study made when the score was 1 + utilization (its fastest trial's value is 1
    or more), resumed: its new trials keep that scale, so the sampler and the pruner compare like
    with like. Recorded as the study attribute `score_offset` the first time."""
    if t.objective is not Objective.utilization:
        return 0.0
    if "score_offset" not in study.user_attrs:
        old = any(tr.state.name == "COMPLETE" and tr.values and tr.values[0] >= 1.0
                  for tr in study.get_trials(deepcopy=False))
        study.set_user_attr("score_offset", 1.0 if old else 0.0)
    return float(study.user_attrs["score_offset"])


def name_objectives(study: Any, t: TuneConfig) -> None:
    """The study's objective values named by what they hold (Optuna's `metric_names`, shown by its
    plots and optuna-dashboard instead of "Objective 0")."""
    import optuna

    names = [OLD_UTILIZATION_NAME] if score_offset(study, t) else METRIC_NAMES[t.objective]
    if study.metric_names != names:
        with warnings.catch_warnings():  # set_metric_names is experimental in Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(names)


def knob_attrs(values: Dict[str, Any]) -> Dict[str, Any]:
    """A trial's knobs as user attributes in user units (`data.batch_size: 32` beside Optuna's
    internal `batch_size_log2: 5`), the keys as the command line writes them."""
    return {key: value for key, value in values.items() if value is not None}


def record_pick(study: Any, best: List[Any], t: TuneConfig) -> Dict[str, Any]:
    """The product's pick as study user attributes: `pick` (trial, whether confirmed, its figures,
    its config, the rule) and `pick_note` (one line, where Optuna's own best_trial is another trial).
    Returns `pick` ({} when there is none)."""
    if not best:
        return {}
    b, conf = best[0], confirmed(study)
    judged = figures(b, conf)
    pick = {"trial": b.number, "confirmed": str(b.number) in conf,
            "figures": {k: judged[k] for k in PICK_FIGURES if isinstance(judged.get(k), (int, float))},
            "config": b.user_attrs.get("values", {}), "rule": rule_words(t)}
    if t.objective is Objective.both:
        pick["pareto_front"] = [tr.number for tr in best]
    optuna_best = _optuna_best(study)
    note = f"the pick is trial {b.number}" + (" (confirmed figures)" if pick["confirmed"] else "")
    if optuna_best is not None and optuna_best != b.number:
        note += (f"; Optuna's best_trial, trial {optuna_best}, is the highest value told during the study, before "
                 "the confirmation runs and against the best throughput seen then")
    study.set_user_attr("pick", pick)
    study.set_user_attr("pick_trial", b.number)
    study.set_user_attr("pick_note", note)
    dashboard_notes(study, b, pick, optuna_best)
    return pick


# the lines the dashboard notes begin with: a note starting so is the product's, replaced when the
# pick is recorded again; a note of the user's own is kept below it
PICK_HEAD = "### The product's pick: trial"
PICKED_HEAD = "### This trial is the study's pick"
KEPT = "\n\n---\n\n"


def dashboard_notes(study: Any, pick_trial: Any, pick: Dict[str, Any], optuna_best: Any) -> None:
    """The pick in optuna-dashboard's notes (Markdown in the study's system attributes, shown on the
    study's page and the trial's): optuna-dashboard's "Best Trial" is Optuna's best_trial, which may
    be another trial. Nothing when optuna-dashboard is not installed."""
    try:
        import optuna_dashboard
    except ImportError:
        return
    import optuna

    text = pick_markdown(pick, optuna_best)
    _save_keeping(optuna_dashboard, study, text)
    # save_note takes a live Trial; a plain sampler's does nothing to the finished trial it opens
    plain = optuna.Study(study.study_name, study._storage, sampler=optuna.samplers.RandomSampler())
    trial = optuna.Trial(plain, pick_trial._trial_id)
    _save_keeping(optuna_dashboard, trial, f"{PICKED_HEAD}\n\n" + text.split("\n", 2)[2])


def _save_keeping(dashboard: Any, target: Any, text: str) -> None:
    """Save the note, keeping below it what a user wrote in the note before (the product's own
    earlier note is replaced)."""
    old = dashboard.get_note(target)
    if old.startswith((PICK_HEAD, PICKED_HEAD)):
        old = old.split(KEPT, 1)[1] if KEPT in old else ""
    dashboard.save_note(target, text + (KEPT + old if old.strip() else ""))


def pick_markdown(pick: Dict[str, Any], optuna_best: Any) -> str:
    """The pick in a few Markdown lines: its config in user units, its figures, the rule, and why
    Optuna's best_trial is another trial where it is."""
    config, f = pick["config"], pick["figures"]
    knobs = [f"batch size {config[BATCH]}" if config.get(BATCH) is not None else "",
             f"{config[WORKERS]} DataLoader workers" if config.get(WORKERS) is not None else "",
             f"accumulation {config[ACCUM]}" if config.get(ACCUM) is not None else "",
             f"learning rate {config.get(LR, f.get('lr')):.3g}" if config.get(LR, f.get("lr")) is not None else ""]
    measured = "confirmed" if pick["confirmed"] else "its trial's, not re-measured"
    lines = [f"{PICK_HEAD} {pick['trial']}", "",
             f"- config: {', '.join(k for k in knobs if k)}",
             f"- figures ({measured}): {figure_words(f)}",
             f"- rule: {pick['rule']}"]
    if optuna_best is not None and optuna_best != pick["trial"]:
        lines.append(f"- the dashboard's \"Best Trial\", trial {optuna_best}, is not the pick: it is Optuna's "
                     "best_trial, the highest value told while the study ran; the pick is judged afterwards, "
                     "by the rule above")
    lines.append("- rerun it from `tuned/best.yaml` in the study's output folder")
    return "\n".join(lines)


def figure_words(f: Dict[str, Any]) -> str:
    """Utilization, samples/s and tokens/s in user units, each with its interval where measured."""
    def one(key: str, label: str, unit: str = "", scale: float = 1.0, fmt: str = ".1f") -> str:
        if not isinstance(f.get(key), (int, float)):
            return ""
        lo, hi = f.get(f"{key}_lo"), f.get(f"{key}_hi")
        both = isinstance(lo, (int, float)) and isinstance(hi, (int, float))
        span = f" ({scale * lo:{fmt}}-{scale * hi:{fmt}}{unit})" if both else ""
        return f"{label} {scale * f[key]:{fmt}}{unit}{span}"

    words = [one("utilization", "utilization", "%", 100), one("throughput", "samples/s"),
             one("tokens_per_s", "real tokens/s", fmt=".0f")]
    return ", ".join(w for w in words if w) or "none measured"


RULES = {Objective.throughput: "the most samples/s", Objective.mfu: "the highest mfu",
         Objective.tokens: "the most real tokens/s",
         Objective.goodput: "the most goodput (samples/s x what a sample is worth at its global batch, at the "
                            "study's gradient noise scale)"}


def rule_words(t: TuneConfig) -> str:
    """The objective's rule in a line."""
    judged = ", judged on the confirmed figures" if t.confirm_top else ", judged on each trial's own figures"
    if t.objective is Objective.utilization:
        return (f"the busiest config (highest utilization) among those within {t.throughput_floor:g} of the fastest "
                f"samples/s{judged}")
    if t.objective is Objective.both:
        return "the Pareto front of utilization and samples/s; the pick is its highest utilization"
    return RULES[t.objective] + judged


def _optuna_best(study: Any) -> Any:
    """Optuna's own best_trial number (None for a multi-objective study or none completed)."""
    if len(study.directions) != 1:
        return None
    try:
        return study.best_trial.number
    except ValueError:
        return None


def tell_mlflow(tracker: Any, study: Any, best: List[Any], t: TuneConfig, parent: Any) -> None:
    """The same answer in MLflow, through the study's `tracker` (tracking.Tracker): each confirmed
    trial's row gets its confirmed figures (`confirmed_throughput` in samples/s,
    `confirmed_utilization_pct` in percent, and their intervals), the pick's row the tags
    `pick=true` and `best=true`, and the study's row a description (MLflow's note) that names the
    pick, its figures and the rule."""
    conf = confirmed(study)
    runs = {tr.number: tr.user_attrs.get("mlflow_run_id") for tr in study.get_trials(deepcopy=False)}
    for number, m in conf.items():
        tracker.log_to(runs.get(int(number)), metrics=confirmed_metrics(m))
    if not best:
        return
    pick = best[0]
    tracker.log_to(runs.get(pick.number), tags={"pick": "true", "best": "true"})
    if parent:
        tracker.log_to(parent, tags={"mlflow.note.content": description(study, pick, t), "pick_trial": str(pick.number)})


def confirmed_metrics(m: Dict[str, Any]) -> Dict[str, float]:
    """A trial's confirmed figures as MLflow metrics, the unit in the name where MLflow shows a raw
    fraction (utilization in percent)."""
    out: Dict[str, float] = {}
    for key in ("throughput", "throughput_lo", "throughput_hi", "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi"):
        if isinstance(m.get(key), (int, float)):
            out[f"confirmed_{key}"] = float(m[key])
    for key in ("utilization", "utilization_lo", "utilization_hi"):
        if isinstance(m.get(key), (int, float)):
            out[f"confirmed_{key}_pct"] = round(100 * float(m[key]), 2)
    return out


def description(study: Any, pick: Any, t: TuneConfig) -> str:
    """The study row's description in MLflow (markdown): the pick, its figures, the rule."""
    f = figures(pick, confirmed(study))
    knobs = ", ".join(f"`{k}={v}`" for k, v in knob_attrs(pick.user_attrs.get("values", {})).items())
    conf = "confirmed" if str(pick.number) in confirmed(study) else "its trial's"
    util = f"utilization {100 * f['utilization']:.1f}%" if isinstance(f.get("utilization"), (int, float)) else ""
    thr = f"{f['throughput']:.1f} samples/s" if isinstance(f.get("throughput"), (int, float)) else ""
    return (f"**Pick: trial {pick.number}** ({knobs}): {', '.join(x for x in (util, thr) if x)} ({conf} figures). "
            f"Rule: {rule_words(t)}. Its run is tagged `pick = true`; rerun it from the study's `tuned/best.yaml`.")
