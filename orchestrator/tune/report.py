"""What a study leaves behind: best.yaml (a Hydra override file), trials.csv, Optuna plots,
summary.json, and a ranked table on the console."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path
from typing import Any, Dict, List

import yaml

from ..commands import orchestrator_command
from ..schema import Objective, TuneConfig

COLUMNS = ("utilization", "throughput", "mfu", "data_wait_frac", "comm_frac", "peak_mem_mb", "duration_s", "measured_s")


def completed(study: Any) -> List[Any]:
    import optuna

    return [t for t in study.get_trials(deepcopy=False)
            if t.state == optuna.trial.TrialState.COMPLETE and "utilization" in t.user_attrs]


def best_trials(study: Any, t: TuneConfig) -> List[Any]:
    """Best first. utilization: highest utilization among trials within throughput_floor of the
    study's best throughput; throughput / mfu: the highest; both: the Pareto front."""
    done = completed(study)
    if not done:
        return []
    if t.objective is Objective.both:
        return sorted(study.best_trials, key=lambda tr: -tr.user_attrs["utilization"])
    if t.objective in (Objective.throughput, Objective.mfu):
        key = t.objective.value
        return sorted(done, key=lambda tr: -(tr.user_attrs.get(key) or 0.0))[:1]
    top = max(tr.user_attrs["throughput"] for tr in done)
    eligible = [tr for tr in done if tr.user_attrs["throughput"] >= t.throughput_floor * top]
    return sorted(eligible, key=lambda tr: -tr.user_attrs["utilization"])[:1]


def final_score(trial: Any, t: TuneConfig, top_throughput: float) -> float:
    """The trial's score against the whole study (the stored value used the best seen so far)."""
    from .study import utilization_score

    a = trial.user_attrs
    if t.objective in (Objective.throughput, Objective.mfu):
        return a.get(t.objective.value) or 0.0
    return utilization_score(a["utilization"], a["throughput"], top_throughput, t.throughput_floor)


def _nested(values: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def write_outputs(tuner: Any, study: Any, best: List[Any]) -> Dict[str, Any]:
    out_dir: Path = tuner.run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    artifacts: List[str] = []
    trials = study.get_trials(deepcopy=False)

    # trials.csv: every trial, its knobs, both figures and its state
    keys = sorted({k for tr in trials for k in tr.user_attrs.get("values", {})})
    csv_path = out_dir / "trials.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", *keys, *COLUMNS, "score", "error"])
        for tr in trials:
            vals = tr.user_attrs.get("values", {})
            score = tr.values[0] if tr.values else ""
            w.writerow([tr.number, tr.state.name, *[vals.get(k, "") for k in keys],
                        *[tr.user_attrs.get(c, "") for c in COLUMNS], score, tr.user_attrs.get("error", "")])
    artifacts.append(str(csv_path))

    from .study import counted

    summary: Dict[str, Any] = {"study_name": tuner.name, "storage": tuner.storage, "objective": tuner.t.objective.value,
                               "n_trials": counted(trials), "proposals": len(trials), "states": {}, "best": None,
                               "pareto_front": []}
    for tr in trials:
        summary["states"][tr.state.name] = summary["states"].get(tr.state.name, 0) + 1
    baseline = next((tr for tr in completed(study) if tr.user_attrs.get("baseline")), None)
    if baseline is not None:
        summary["baseline"] = {"number": baseline.number, "values": baseline.user_attrs["values"],
                               **{c: baseline.user_attrs.get(c) for c in COLUMNS}}
    if best:
        b = best[0]
        values = b.user_attrs["values"]
        summary["best"] = {"number": b.number, "values": values, **{c: b.user_attrs.get(c) for c in COLUMNS}}
        if tuner.t.objective is Objective.both:
            summary["pareto_front"] = [{"number": tr.number, "values": tr.user_attrs["values"],
                                        "utilization": tr.user_attrs["utilization"],
                                        "throughput": tr.user_attrs["throughput"]} for tr in best]
        tuned = out_dir / "tuned"
        tuned.mkdir(exist_ok=True)
        best_yaml = tuned / "best.yaml"
        rerun = orchestrator_command(["--config-dir", str(tuned.parent), *tuner.overrides, "+tuned=best"])
        best_yaml.write_text(
            "# @package _global_\n"
            f"# Best trial {b.number} of study '{tuner.name}' (objective {tuner.t.objective.value}).\n"
            f"# Rerun: {rerun}\n"
            + yaml.safe_dump(_nested(values), sort_keys=True)
        )
        artifacts.append(str(best_yaml))
        overrides = " ".join(shlex.quote(f"{k}={'null' if v is None else v}") for k, v in values.items())
        summary["rerun"] = rerun
        summary["rerun_overrides"] = overrides
    summary["trial_overhead"] = _overhead(trials)
    artifacts += _plots(study, out_dir, tuner.t)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    artifacts.append(str(out_dir / "summary.json"))
    summary["artifacts"] = artifacts
    if tuner.echo:
        _print_table(study, best, tuner, summary)
    return summary


def _overhead(trials: List[Any]) -> Dict[str, float]:
    """Share of each completed trial's wall time spent outside its measured window."""
    shares = [1 - tr.user_attrs["measured_s"] / tr.user_attrs["duration_s"] for tr in trials
              if tr.user_attrs.get("duration_s") and tr.user_attrs.get("measured_s") is not None
              and "utilization" in tr.user_attrs]
    if not shares:
        return {}
    shares.sort()
    return {"median": shares[len(shares) // 2], "min": shares[0], "max": shares[-1]}


def _plots(study: Any, out_dir: Path, t: TuneConfig) -> List[str]:
    """Optuna's matplotlib plots as PNG (each skipped, with a note, when the study can't make it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm
    import warnings

    kwargs = {"target": lambda tr: tr.values[0], "target_name": "utilization"} if t.objective is Objective.both else {}
    made = []
    for name, fn in (("optimization_history", ovm.plot_optimization_history),
                     ("param_importances", ovm.plot_param_importances),
                     ("parallel_coordinate", ovm.plot_parallel_coordinate)):
        path = out_dir / f"{name}.png"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = fn(study, **kwargs)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(9, 5)
            fig.tight_layout()
            fig.savefig(path, dpi=80)
            plt.close(fig)
            made.append(str(path))
        except Exception as exc:  # e.g. importances need 2+ completed trials with varied params
            print(f"[tune] no {name} plot: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return made


def _print_table(study: Any, best: List[Any], tuner: Any, summary: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    best_numbers = {b.number for b in best}
    done = completed(study)
    top = max(tr.user_attrs["throughput"] for tr in done) if done else 0.0
    score = {tr.number: final_score(tr, tuner.t, top) for tr in done}
    done.sort(key=lambda tr: (tr.number not in best_numbers, -score[tr.number]))
    table = Table(title=f"study {tuner.name}: {summary['states']}")
    for col in ("rank", "trial", "knobs", "utilization", "throughput", "data wait", "comm", "score", ""):
        table.add_column(col)
    for i, tr in enumerate(done, 1):
        a = tr.user_attrs
        knobs = " ".join(f"{k.split('.')[-1]}={v}" for k, v in a["values"].items() if v is not None)
        table.add_row(str(i), str(tr.number), knobs, f"{100 * a['utilization']:.1f}%", f"{a['throughput']:.1f}",
                      f"{100 * a.get('data_wait_frac', 0):.1f}%", f"{100 * a.get('comm_frac', 0):.1f}%",
                      f"{score[tr.number]:.3f}", ("best" if tr.number in best_numbers else "")
                      + (" baseline" if a.get("baseline") else ""))
    Console(width=140).print(table)
    if summary.get("best"):
        print(f"[tune] best: trial {summary['best']['number']}: {summary['rerun_overrides']}")
        print(f"[tune] rerun it: {summary['rerun']}")
