"""What a study leaves behind: best.yaml (a Hydra override file), trials.csv, Optuna plots, the
tuning picture (picture.py), summary.json, and a ranked table on the console."""

from __future__ import annotations

import csv
import io
import shlex
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml

from ..commands import orchestrator_command
from ..progress import console
from ..rundir import write_atomic, write_json
from ..schema import Objective, TuneConfig
from ..stores import redact
from .advise import pick_advice
from .answer import record_pick
from .edges import advice
from .evidence import POOLED_ATTR
from .goodput import judged, scale_of
from .space import knob_words
from .picture import FILE as PICTURE, write_picture
from .rules import (best_trials, completed, confirmed, counted, failed_confirmation, figures, pickable, ranked, refused,
                    separation, versus_baseline)
from .warm import VALUES_ATTR

# Optuna's importances (a random forest over the completed trials) are noise below this many trials;
# the plot also costs the first scikit-learn import, 2-3 s of a 6-trial study on 2 cores
IMPORTANCE_MIN_TRIALS = 10
COLUMNS = ("utilization", "throughput", "throughput_lo", "throughput_hi", "rel_se", "windows", "measured_s",
           "stopped_by", "mfu", "data_wait_frac", "comm_frac", "peak_mem_mb", "duration_s", "global_batch",
           "steps_per_epoch", "last_window_utilization", "last_window_throughput", "prune_reason",
           "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi", "padding_frac", "last_window_tokens_per_s",
           "lr", "efficiency", "goodput")
CONFIRMED_COLUMNS = ("utilization", "throughput", "throughput_lo", "throughput_hi", "rel_se", "windows", "measured_s",
                     "runs", "tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi")


def state_word(trial: Any) -> str:
    """A trial's state as reported: Optuna's word, or DIVERGED for a failed trial whose loss diverged."""
    return "DIVERGED" if trial.user_attrs.get("diverged") else trial.state.name


def _nested(values: Dict[str, Any]) -> Dict[str, Any]:
    """Dotted `key: value` pairs as the nested mapping an override file holds."""
    from omegaconf import OmegaConf

    node = OmegaConf.create()
    for key, value in values.items():
        OmegaConf.update(node, key, value, force_add=True)
    return OmegaConf.to_container(node)  # type: ignore[return-value]


def write_outputs(study: Any, best: List[Any], *, t: TuneConfig, out_dir: Path, name: str, storage: str,
                  overrides: List[str], echo: bool, notes: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The study's files in `out_dir` (its `name`, `storage`, and the CLI `overrides` for the
    rerun line; `notes`: stopped, edges, global_batch, pruning, see outcome.StudyOutcome._notes);
    with `echo`, the ranked table. Returns the summary (also summary.json)."""
    notes = {"stopped": None, "edges": [], "global_batch": None, "pruning": {}, **(notes or {})}
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    artifacts = [_write_trials_csv(study, trials, out_dir)]
    summary = _summary(study, trials, best, t, name, storage, notes)
    if best:
        artifacts.append(_write_best(summary, best[0], t, out_dir, name, storage, overrides, notes))
        study.set_user_attr(VALUES_ATTR, summary["pick_values"])  # trainer.tuned and a warm start read it (warm.py)
    summary["pick"] = record_pick(study, best, t)  # Optuna's readers see the same answer
    if best:
        summary["pick_advice"] = pick_advice(study, summary["pick"], out_dir / "trials" / f"{best[0].number:04d}", name)
    summary["trial_overhead"] = _overhead(trials)
    artifacts += _plots(study, best, out_dir, t, say=print if echo else lambda line: None)
    write_json(out_dir / "summary.json", summary, indent=2)
    artifacts.append(str(out_dir / "summary.json"))
    summary["artifacts"] = artifacts
    if echo:
        _print_table(study, best, t, name, summary)
    return summary


def _write_trials_csv(study: Any, trials: List[Any], out_dir: Path) -> str:
    """trials.csv: every trial, its knobs, both figures, its confirmed figures and its state."""
    keys = sorted({k for tr in trials for k in tr.user_attrs.get("values", {})})
    csv_path = out_dir / "trials.csv"
    rows = io.StringIO(newline="")
    w = csv.writer(rows)
    conf = confirmed(study)
    w.writerow(["number", "state", "proposed_by", *keys, *COLUMNS, *[f"confirmed_{c}" for c in CONFIRMED_COLUMNS],
                "score", "pooled", "verdict", "reason", "error"])
    for tr in trials:
        a = tr.user_attrs
        vals = a.get("values", {})
        score = tr.values[0] if tr.values else ""
        row = conf.get(str(tr.number), {})
        w.writerow([tr.number, state_word(tr), a.get("proposed_by", ""), *[vals.get(k, "") for k in keys],
                    *[a.get(c, "") for c in COLUMNS], *[row.get(k, "") for k in CONFIRMED_COLUMNS],
                    score, pooled_words(tr), a.get("verdict", ""), a.get("reason") or a.get("predicted_below", ""),
                    a.get("error", "")])
    write_atomic(csv_path, rows.getvalue())
    return str(csv_path)


def _summary(study: Any, trials: List[Any], best: List[Any], t: TuneConfig, name: str, storage: str,
             notes: Dict[str, Any]) -> Dict[str, Any]:
    """summary.json's body: the study, its trials' states, the baseline, the confirmation, how far
    the pick stands from the runner-up and from the user's config, and the pick."""
    summary: Dict[str, Any] = {"study_name": name, "storage": redact(storage), "objective": t.objective.value,
                               "n_trials": counted(trials), "proposals": len(trials), "states": {}, "best": None,
                               "pareto_front": [], **notes}
    for tr in trials:
        summary["states"][state_word(tr)] = summary["states"].get(state_word(tr), 0) + 1
    baseline = next((tr for tr in completed(study) if tr.user_attrs.get("baseline")), None)
    if baseline is not None:
        summary["baseline"] = {"number": baseline.number, "values": baseline.user_attrs["values"],
                               **{c: baseline.user_attrs.get(c) for c in COLUMNS}}
    summary["refused"] = [{"trial": tr.number, "global_batch": tr.user_attrs.get("global_batch"),
                           "steps_per_epoch": tr.user_attrs["steps_per_epoch"]}
                          for tr in completed(study) if refused(tr, t)]
    conf = confirmed(study)
    if conf:
        summary["confirmed"] = conf
    if failed_confirmation(study):
        summary["confirm_failed"] = failed_confirmation(study)
    if study.user_attrs.get("confirm_left_out"):  # runs the host's other load slowed (confirm.left_out)
        summary["confirm_left_out"] = study.user_attrs["confirm_left_out"]
    summary["separation"] = separation(study, t)
    summary["versus_baseline"] = versus_baseline(study, t)
    if best:
        b = best[0]
        judged = figures(b, conf)
        summary["best"] = {"number": b.number, "values": b.user_attrs["values"], **{c: b.user_attrs.get(c) for c in COLUMNS},
                           **{k: judged.get(k) for k in CONFIRMED_COLUMNS if k in judged},
                           "confirmed": str(b.number) in conf, **({"pooled": pooled_words(b)} if pooled_words(b) else {})}
        if t.objective is Objective.both:
            summary["pareto_front"] = [{"number": tr.number, "values": tr.user_attrs["values"],
                                        "utilization": tr.user_attrs["utilization"],
                                        "throughput": tr.user_attrs["throughput"]} for tr in best]
    return summary


# measure.* keys that set a trial's stop rule: a study's own, left out of its rerun, which trains the whole run
TRIAL_STOP_KEYS = ("measure.rel_precision", "measure.min_measure_s", "measure.max_measure_s", "measure.trial_steps")


def rerun_overrides(overrides: List[str]) -> List[str]:
    """The study's CLI overrides a rerun of its pick keeps: all but its trials' stop rule."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in TRIAL_STOP_KEYS]


def _write_best(summary: Dict[str, Any], b: Any, t: TuneConfig, out_dir: Path, name: str, storage: str,
                overrides: List[str], notes: Dict[str, Any]) -> str:
    """tuned/best.yaml: the pick `b` as a Hydra override file, with the learning rate (and its
    warmup) tune.lr_scaling gives its global batch; its rerun command and overrides go into
    `summary`. Returns its path."""
    tuned = out_dir / "tuned"
    tuned.mkdir(exist_ok=True)
    best_yaml = tuned / "best.yaml"
    values = {**b.user_attrs["values"], **((notes.get("time_to_target") or {}).get("set") or {})}
    rerun = orchestrator_command(["--config-dir", str(tuned.parent), *rerun_overrides(overrides), "+tuned=best"])
    write_atomic(
        best_yaml,
        "# @package _global_\n"
        f"# Best trial {b.number} of study '{name}' (objective {t.objective.value}).\n"
        f"# Rerun: {rerun}\n"
        + "".join(f"# Note: {line}\n" for line in _header_notes(notes))
        + yaml.safe_dump(_nested({**values, **_tuned_tags(name, storage)}), sort_keys=True)
    )
    summary["rerun"] = rerun
    summary["pick_values"] = values
    summary["rerun_overrides"] = " ".join(shlex.quote(f"{k}={_override_value(v)}") for k, v in values.items())
    return str(best_yaml)


def _override_value(v: Any) -> str:
    """A value as a Hydra override writes it (null, true/false)."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _tuned_tags(name: str, storage: str) -> Dict[str, str]:
    """Tags of the rerun of best.yaml naming the study (its advice is checked against it,
    tune/advise.py); the storage only where its URL holds no password."""
    if redact(storage) != storage:
        return {"tags.tuned_study": name}
    return {"tags.tuned_study": name, "tags.tuned_storage": storage}


def floor_line(study: Any, best: List[Any], t: TuneConfig) -> str:
    """The utilization objective's floor rule at the pick, in a line: the fastest compared config,
    the pick (the busiest within the floor of it), and the busier ones the floor left out; '' for
    other objectives."""
    if t.objective is not Objective.utilization or not best:
        return ""
    conf, pick = confirmed(study), best[0]
    pool = [tr for tr in pickable(study, t) if str(tr.number) in conf] if str(pick.number) in conf else pickable(study, t)
    fig = {tr.number: figures(tr, conf) for tr in pool}
    fig.setdefault(pick.number, figures(pick, conf))
    fastest = max(fig, key=lambda n: fig[n]["throughput"])
    top, p = fig[fastest]["throughput"], fig[pick.number]
    said = (f"[tune] picked trial {pick.number}, the busiest config within {t.throughput_floor:g} of the fastest "
            f"samples/s: utilization {100 * p['utilization']:.1f}% at {p['throughput']:.1f}/s"
            + (f" (the fastest, trial {fastest}, {top:.1f}/s)" if fastest != pick.number else " (the fastest)"))
    busier = sorted((n for n, f in fig.items() if f["utilization"] > p["utilization"] and n != pick.number),
                    key=lambda n: -fig[n]["utilization"])
    if busier:
        said += "; busier but under the floor or too likely to be: " + ", ".join(
            f"trial {n} ({100 * fig[n]['utilization']:.1f}% at {fig[n]['throughput'] / top:.2f}x)" for n in busier[:3])
    return said + ("; judged on the confirmed figures" if str(pick.number) in conf else "")


def pooled_words(trial: Any) -> str:
    """How many measurements a warm study's trial is judged by, and how many came from the study it
    started from (evidence.py); '' when they are its own."""
    return (trial.user_attrs.get(POOLED_ATTR) or {}).get("words", "")


def _trials(numbers: List[Any]) -> str:
    return f"trial{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"


def _pruning_line(p: Dict[str, Any]) -> str:
    """What pruning did: the trial time it saved, or that it saved none (the pruned trials ran as
    long as the completed ones take: their warmup and first windows are the cost of a trial)."""
    n = p["pruned"]
    said = f"[tune] pruning ({p.get('pruner', 'median')}) stopped {n} trial{'s' if n != 1 else ''} early"
    if p["saved_s"] >= 1 or "spent_s" not in p:
        said += f", saving about {p['saved_s']:.0f}s of trial time"
    else:
        said += (f" but saved no trial time: {'they' if n != 1 else 'it'} ran {p['spent_s']:.1f}s in all, where a "
                 f"completed trial takes {p['median_s']:.1f}s (median)")
    near = p.get("within_noise_of_best") or []
    return said + (f"; {_trials(near)} had a last window within the best's interval" if near else "")


def best_words(study: Any, t: TuneConfig) -> str:
    """The best so far in a few words (the live progress): its trial, utilization and samples/s
    (real tokens/s for the tokens objective) with the 95% interval, from its confirmed figures when
    it was re-measured."""
    best = best_trials(study, t)
    if not best:
        return ""
    f = figures(best[0], confirmed(study))
    name, unit = ("tokens_per_s", "real tokens/s") if t.objective is Objective.tokens else ("throughput", "samples/s")
    if f.get(name) is None:
        return f"trial {best[0].number}: utilization {100 * f['utilization']:.1f}%"
    return (f"trial {best[0].number}: utilization {100 * f['utilization']:.1f}%, "
            f"{f[name]:.1f}{interval_words(f, name)} {unit}")


def interval_words(f: Dict[str, Any], name: str, unit: float = 1.0, fmt: str = "{:.1f}") -> str:
    """` (lo-hi)`: a figure's 95% interval as shown, its low end at 0 at least (the t interval of a
    trial stopped at max_measure_s after 2 windows reaches far below 0; no rate does); '' without one."""
    lo, hi = f.get(f"{name}_lo"), f.get(f"{name}_hi")
    return f" ({fmt.format(unit * max(0.0, lo))}-{fmt.format(unit * hi)})" if lo is not None and hi is not None else ""


def _header_notes(notes: Dict[str, Any]) -> List[str]:
    stopped = notes.get("stopped") or {}
    unfinished = [f"the study was {stopped['why']}"] if "counted" in stopped else []  # a pick that is not final
    return (unfinished + ([notes["global_batch"]["note"]] if notes.get("global_batch") else [])
            + [e["note"] for e in notes["edges"]] + time_to_target_lines(notes.get("time_to_target") or {}))


def _overhead(trials: List[Any]) -> Dict[str, float]:
    """Share of each completed trial's wall time spent outside its measured window."""
    shares = [1 - tr.user_attrs["measured_s"] / tr.user_attrs["duration_s"] for tr in trials
              if tr.user_attrs.get("duration_s") and tr.user_attrs.get("measured_s") is not None
              and "utilization" in tr.user_attrs]
    if not shares:
        return {}
    shares.sort()
    return {"median": shares[len(shares) // 2], "min": shares[0], "max": shares[-1]}


def import_plotting(n_trials: int) -> None:
    """Import what `_plots` will need (matplotlib; scikit-learn, behind Optuna's importances, from
    IMPORTANCE_MIN_TRIALS trials): the study calls this while its ranks start, when the first trial
    waits for them anyway. Imported at the report they would add a few seconds to the study's wall
    time on 2 cores."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        import optuna.visualization.matplotlib  # noqa: F401

        if n_trials >= IMPORTANCE_MIN_TRIALS:
            import optuna.importance

            optuna.importance.FanovaImportanceEvaluator  # noqa: B018  (a lazy attribute: loads scikit-learn)
    except Exception:  # noqa: BLE001 -- a plot it cannot make is said by _plots, at the report
        pass


def _plots(study: Any, best: List[Any], out_dir: Path, t: TuneConfig, say: Callable[[str], None] = print) -> List[str]:
    """Optuna's matplotlib plots as PNG (each skipped, with a note to `say`, when the study can't make it),
    and the tuning picture in user units (picture.py), its pick `best[0]`, the one best.yaml holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm
    import warnings

    kwargs = {"target": lambda tr: tr.values[0], "target_name": "utilization"} if t.objective is Objective.both else {}
    made = []
    n_done = len(completed(study))
    for name, fn in (("optimization_history", ovm.plot_optimization_history),
                     ("param_importances", ovm.plot_param_importances),
                     ("parallel_coordinate", ovm.plot_parallel_coordinate)):
        path = out_dir / f"{name}.png"
        if name == "param_importances" and n_done < IMPORTANCE_MIN_TRIALS:
            say(f"[tune] no {name} plot: {n_done} completed trials, importances need {IMPORTANCE_MIN_TRIALS} "
                  "(a forest fitted to fewer ranks noise)")
            continue
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
            say(f"[tune] no {name} plot: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    try:
        picture = write_picture(study, best, t, out_dir)
        made += [str(picture)] if picture else []
    except Exception as exc:
        say(f"[tune] no {PICTURE} picture: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return made


def _print_table(study: Any, best: List[Any], t: TuneConfig, name: str, summary: Dict[str, Any]) -> None:
    """The ranked table of the completed trials on the console, then what the summary says of the pick."""
    console().print(_table(study, best, t, name, summary))
    for line in _verdict_lines(study, best, t, summary):
        print(line)


def _table(study: Any, best: List[Any], t: TuneConfig, name: str, summary: Dict[str, Any]) -> Any:
    """The completed trials ranked (a rich Table): knobs, figures (confirmed where re-measured),
    verdict and notes."""
    from rich.table import Table

    best_numbers = {b.number for b in best}
    conf, scale = confirmed(study), scale_of(study)
    if t.objective is Objective.both:
        done = sorted(completed(study), key=lambda tr: (tr.number not in best_numbers, -tr.user_attrs["utilization"]))
    else:
        done = ranked(study, t)
    table = Table(title=f"study {name}: {summary['states']}")
    tokens = t.objective is Objective.tokens  # the figure it ranks by, beside samples/s
    good = t.objective is Objective.goodput
    for col in ("rank", "trial", "by", "knobs", "utilization", "throughput (95% interval)",
                *(("real tokens/s (95% interval)",) if tokens else ()), *(("goodput (x efficiency)",) if good else ()),
                "verdict", "notes"):
        table.add_column(col)

    failed = failed_confirmation(study)
    for i, tr in enumerate(done, 1):
        a, f = tr.user_attrs, judged(tr, figures(tr, conf), scale)
        knobs = knob_words(a["values"])
        notes = [n for n, on in (("best", tr.number in best_numbers), ("confirmed", str(tr.number) in conf),
                                 ("baseline", a.get("baseline")), ("refused", refused(tr, t)),
                                 ("failed when confirmed", str(tr.number) in failed),
                                 (f"pooled: {pooled_words(tr)}", pooled_words(tr))) if on]
        real = (("-" if f.get("tokens_per_s") is None else f"{f['tokens_per_s']:.0f}"
                 + interval_words(f, "tokens_per_s", 1.0, "{:.0f}")),) if tokens else ()
        shown = f"{f['throughput']:.1f}" + interval_words(f, "throughput", 1.0, "{:.0f}")
        if good:
            real = ("-" if f.get("goodput") is None else f"{f['goodput']:.1f} (x{f['efficiency']:.2g})",)
        table.add_row(str(i), str(tr.number), a.get("proposed_by", "-"), knobs, f"{100 * f['utilization']:.1f}%",
                      shown, *real, a.get("verdict", "-"), " ".join(notes))
    return table


def _verdict_lines(study: Any, best: List[Any], t: TuneConfig, summary: Dict[str, Any]) -> List[str]:
    """What the console says under the table: the floor, how far the pick stands from the
    runner-up and from the user's config, why the study stopped, what was not picked or not
    launched, where the time went, the pick's edges and global batch, its time to the target,
    and the pick with its rerun command."""
    lines = [floor] if (floor := floor_line(study, best, t)) else []
    sep = summary.get("separation") or {}
    if sep.get("separated") is False:
        figure = "real tokens/s" if sep["figure"] == "tokens_per_s" else sep["figure"]
        lines.append(f"[tune] trial {sep['winner']} is not ahead of trial {sep['runner_up']} by more than the noise "
                     f"(their {figure} intervals overlap): either is as good")
    vs = summary.get("versus_baseline") or {}
    if vs and vs["best"] != vs["baseline"]:
        lines.append(f"[tune] trial {vs['best']} against your config (trial {vs['baseline']}), "
                     + ("measured side by side" if vs["side_by_side"] else "single trials measured apart")
                     + f": {vs['throughput_ratio']:.2f}x the samples/s ({vs['throughput_ratio_lo']:.2f}-"
                     f"{vs['throughput_ratio_hi']:.2f}), utilization {100 * vs['utilization']:.1f}% against "
                     f"{100 * vs['baseline_utilization']:.1f}%")
    if summary.get("stopped"):
        lines.append(f"[tune] stopped early: {summary['stopped']['why']}")
    if summary["refused"]:
        lines.append(f"[tune] not picked: {_trials([r['trial'] for r in summary['refused']])} "
                     f"train{'s' if len(summary['refused']) == 1 else ''} one optimizer step per epoch (the global "
                     "batch covers the dataset); allow with tune.allow_large_global_batch=true")
    if summary["pruning"]:
        lines.append(_pruning_line(summary["pruning"]))
    if summary.get("not_launched"):
        lines.append(f"[tune] not launched: {_trials([r['trial'] for r in summary['not_launched']])}, which the "
                     "job model predicts cannot reach the objective's floor (trials.csv: reason)")
    lines += _share_lines(summary.get("measured_share") or {})
    lines += [f"[tune] edge: {advice(edge, t.extend_edges)}" for edge in summary["edges"]]
    if summary["global_batch"]:
        lines.append(f"[tune] global batch: {summary['global_batch']['note']}")
    lines += [f"[tune] {line}" for line in time_to_target_lines(summary.get("time_to_target") or {})]
    if summary.get("best"):
        unfinished = (summary.get("stopped") or {}).get("counted")
        best_word = "best" if unfinished is None else f"best so far (not final: {unfinished} of {t.n_trials} trials)"
        lines.append(f"[tune] {best_word}: trial {summary['best']['number']}: {summary['rerun_overrides']}")
        lines.append(f"[tune] rerun it: {summary['rerun']}")
    return lines


def _share_lines(share: Dict[str, Any]) -> List[str]:
    """Where the study's time went (outcome.StudyOutcome._measured_share), in one line."""
    if not share.get("wall_s"):
        return []
    spent = share.get("spent") or {}
    rest = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in spent.items() if k != "measuring")
    return [f"[tune] measuring took {share['measured_s']:.1f}s of the study's {share['wall_s']:.1f}s "
            f"({100 * share['share']:.0f}%)" + (f"; the rest: {rest}" if rest else "")]


def time_to_target_lines(tt: Dict[str, Any]) -> List[str]:
    """The pick's time to the user's target (goodput.time_to_target) as the console says it."""
    lines = [f"set aside: {tt['guard']}"] if tt.get("guard") else []
    if tt.get("line"):
        pooled = tt.get("noise_scale")
        lines.append(tt["line"] + (f" (noise scale {pooled['b_simple']:.3g}: {pooled['how']})" if pooled else ""))
    if tt.get("set", {}).get("trainer.lr") is not None:
        warm = tt["set"].get("trainer.warmup_lr_steps")
        lines.append(f"best.yaml sets trainer.lr={tt['set']['trainer.lr']:.4g} ({tt['rule_used']} from your "
                     f"{tt['user_lr']:g} at global batch {tt['user_global_batch']})"
                     + (f" with trainer.warmup_lr_steps={warm}" if warm else ""))
    return lines
