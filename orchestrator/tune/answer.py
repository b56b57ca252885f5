"""What the study says to the readers of Optuna's own records (`optuna.load_study`,
`study.best_trial`, optuna-dashboard): its objectives named in their units, each trial's knobs in
user units beside the sampler's internal parameters, and the product's pick as study attributes.

Optuna's `best_trial` is the highest value told during the study; a utilization trial's value was
scored against the best throughput seen when it ended, and the pick is made afterwards from the
confirmation runs (rules.best_trials), so the two may differ. The study attribute `pick` is the
answer (its trial, its confirmed figures, its config); `pick_note` says so in a line wherever
Optuna's best disagrees."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

from ..schema import Objective, TuneConfig
from .rules import confirmed, figures

# Optuna's metric names, one per objective value (the value's unit)
METRIC_NAMES = {
    Objective.utilization: ["utilization (below the throughput floor: minus the share of samples/s lost)"],
    Objective.throughput: ["samples/s"],
    Objective.mfu: ["mfu"],
    Objective.tokens: ["real tokens/s"],
    Objective.both: ["utilization", "samples/s"],
}
PICK_FIGURES = ("utilization", "utilization_lo", "utilization_hi", "throughput", "throughput_lo", "throughput_hi",
                "mfu", "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi", "runs")


def name_objectives(study: Any, t: TuneConfig) -> None:
    """The study's objective values named by what they hold (Optuna's `metric_names`, shown by its
    plots and optuna-dashboard instead of "Objective 0")."""
    import optuna

    names = METRIC_NAMES[t.objective]
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
    return pick


def rule_words(t: TuneConfig) -> str:
    """The objective's rule in a line."""
    if t.objective is Objective.utilization:
        return (f"the busiest config (highest utilization) among those within {t.throughput_floor:g} of the fastest "
                "samples/s, judged on the confirmed figures")
    if t.objective is Objective.both:
        return "the Pareto front of utilization and samples/s; the pick is its highest utilization"
    return {Objective.throughput: "the most samples/s", Objective.mfu: "the highest mfu",
            Objective.tokens: "the most real tokens/s"}[t.objective] + ", judged on the confirmed figures"


def _optuna_best(study: Any) -> Any:
    """Optuna's own best_trial number (None for a multi-objective study or none completed)."""
    if len(study.directions) != 1:
        return None
    try:
        return study.best_trial.number
    except ValueError:
        return None
