"""Advice for a study's pick that agrees with the study that picked it.

A run's diagnosis (diagnose.py) advises moves from that run's own figures alone: for a study's
pick (its trial, or the rerun of tuned/best.yaml) it may advise a config the study measured and did
not pick (`data.num_workers=8` where a trial ran it). Here each move that sets a knob the study
tuned is checked against the study's measured trials:

- the config it leads to was measured: the move is dropped, and a note says which trial measured
  it and that the study picked this one (by its objective's rule);
- it sets a tuned knob past the values the study measured (a batch beyond its space, or beyond
  what its trials reached): kept, saying it goes past what the study measured;
- it sets tuned knobs to values measured only with other knobs: kept, saying so.

Moves on knobs the study did not tune are kept as they are.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .space import NEEDS_WORKERS

Trial = Tuple[int, Dict[str, Any], Dict[str, Any]]  # (number, its values, its figures)


def check_moves(moves: List[Dict[str, Any]], pick: Trial, trials: List[Trial], study: str,
                rule: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    """(moves kept, each with its `why` completed where the study bears on it; notes on the moves
    dropped). `moves`: a diagnosis' moves ({"set", "why"}); `pick`: the pick; `trials`: the study's
    measured trials; `rule`: the objective's rule in words (answer.rule_words)."""
    tuned = {k for _, values, _ in trials for k in values} - set(NEEDS_WORKERS)
    kept: List[Dict[str, Any]] = []
    dropped: List[str] = []
    for move in moves:
        keys = [k for k in move["set"] if k in tuned]
        if not keys:
            kept.append(move)
            continue
        target = {**pick[1], **move["set"]}
        knobs = " ".join(f"{k}={_fmt(move['set'][k])}" for k in keys)
        twin = next((t for t in trials if t[0] != pick[0] and all(t[1].get(k) == target.get(k) for k in tuned)), None)
        if twin is not None:
            dropped.append(f"not {knobs}: study '{study}' measured it as trial {twin[0]} ({_figures(twin[2])}) and "
                           f"picked trial {pick[0]} ({_figures(pick[2])}) by its rule, {rule}")
            continue
        past = [p for k in keys if (p := _past(k, move["set"][k], trials)) is not None]
        if past:
            why = (f"past what study '{study}' measured ({'; '.join(past)}): untested by the study; widen "
                   "tune.space or rerun the study to weigh it against the pick")
        else:
            why = f"study '{study}' measured {knobs} only with other knobs, not with this config"
        kept.append({**move, "why": f"{move['why']} ({why})"})
    return kept, dropped


def _past(key: str, value: Any, trials: List[Trial]) -> Optional[str]:
    """`key` from lowest to highest measured, when `value` lies outside (None inside, or not numeric)."""
    seen = [v[key] for _, v, _ in trials if isinstance(v.get(key), (int, float)) and not isinstance(v.get(key), bool)]
    if not seen or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    lo, hi = min(seen), max(seen)
    return None if lo <= value <= hi else f"{key} {_fmt(lo)}-{_fmt(hi)}"


def _fmt(v: Any) -> str:
    """As diagnose.Move.text writes a value."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _figures(f: Dict[str, Any]) -> str:
    parts = []
    if isinstance(f.get("throughput"), (int, float)):
        parts.append(f"{f['throughput']:.1f} samples/s")
    if isinstance(f.get("utilization"), (int, float)):
        parts.append(f"utilization {100 * f['utilization']:.1f}%")
    return ", ".join(parts) or "no figures"


def study_trials(study: Any) -> List[Trial]:
    """The study's measured trials as (number, values, figures), confirmed figures where re-measured."""
    from .rules import completed, confirmed, figures

    conf = confirmed(study)
    return [(tr.number, tr.user_attrs.get("values", {}), figures(tr, conf)) for tr in completed(study)]


def agree(diagnosis: Dict[str, Any], study: Any, pick_number: int, study_name: str, rule: str) -> Dict[str, Any]:
    """A diagnosis (Diagnosis.as_dict) checked against `study` for its pick `pick_number`: moves
    kept or dropped (check_moves), the advice lines rebuilt, `study_notes` the dropped ones."""
    trials = study_trials(study)
    pick = next((t for t in trials if t[0] == pick_number), None)
    if pick is None:
        return diagnosis
    moves, dropped = check_moves(diagnosis.get("moves") or [], pick, trials, study_name, rule)
    notes = [a for a in diagnosis.get("advice", []) if not any(a.startswith(_text_start(m)) for m in diagnosis.get("moves") or [])]
    return {**diagnosis, "moves": moves, "study_notes": dropped,
            "advice": [f"{', '.join(f'{k}={_fmt(v)}' for k, v in m['set'].items())}: {m['why']}" for m in moves]
            + notes + dropped}


def _text_start(move: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in move["set"].items()) + ":"


def load_and_agree(diagnosis: Dict[str, Any], study_name: str, storage: str) -> Dict[str, Any]:
    """The rerun of a study's pick (tuned/best.yaml tags it `tuned_study`, `tuned_storage`): its
    diagnosis checked against that study; as it was when the study cannot be read."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except Exception:  # noqa: BLE001 - moved or deleted: the run's own advice stands
        return diagnosis
    pick = study.user_attrs.get("pick") or {}
    if "trial" not in pick:
        return diagnosis
    return agree(diagnosis, study, int(pick["trial"]), study_name, pick.get("rule") or "its objective's rule")


def rerun_advice(run_dir: Any, study_name: str, storage: str) -> Optional[Dict[str, Any]]:
    """The rerun of a study's pick (tuned/best.yaml tags it `tuned_study`, `tuned_storage`): its
    advice checked against that study and written under its load_report.md, as for the pick's own
    trial (pick_advice); None when the study cannot be read or holds no pick."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except Exception:  # noqa: BLE001 - moved or deleted: the run's own advice stands
        return None
    return pick_advice(study, study.user_attrs.get("pick") or {}, run_dir, study_name)


def pick_advice(study: Any, pick: Dict[str, Any], trial_dir: Any, study_name: str) -> Optional[Dict[str, Any]]:
    """The pick's own advice (its trial's diagnosis, result.json) checked against the study, and
    written under its load_report.md ("Against the study", the report itself left as measured);
    None when the trial's records are not in `trial_dir` (another tuner process ran it)."""
    from pathlib import Path

    from ..rundir import read_json, write_atomic

    trial_dir = Path(trial_dir)
    diagnosis = (read_json(trial_dir / "result.json", {}) or {}).get("diagnosis")
    if not diagnosis or "trial" not in pick:
        return None
    checked = agree(diagnosis, study, int(pick["trial"]), study_name, pick.get("rule") or "its objective's rule")
    report = trial_dir / "load_report.md"
    if report.exists():
        # an earlier "Against the study" section replaced; the drift note's own section kept
        text = report.read_text().split(f"\n{AGAINST}\n", 1)[0].rstrip("\n")
        lines = [f"- {a}" for a in checked["advice"]] or ["- nothing to change within what the study measured"]
        write_atomic(report, f"{text}\n\n{AGAINST}\n\nThis trial is the pick of study '{study_name}'; its advice "
                             "above, checked against the trials the study measured:\n\n" + "\n".join(lines) + "\n")
    return checked


AGAINST = "## Against the study"


def study_drift(run_dir: Any, result: Dict[str, Any], study_name: str, storage: str, retune: str) -> Optional[str]:
    """`drift` of a run of a study's pick against that study (None: the study cannot be read, or
    the run is inside its interval), also written under the run's load_report.md."""
    import optuna
    from pathlib import Path

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except Exception:  # noqa: BLE001 - moved or deleted: nothing to compare with
        return None
    note = drift(result, study.user_attrs.get("pick") or {}, study_name, retune)
    report = Path(run_dir) / "load_report.md"
    if note and report.exists():
        with report.open("a", encoding="utf-8") as f:
            f.write(f"\n## Against the study's figures\n\n- {note}\n")
    return note


def drift(result: Dict[str, Any], pick: Dict[str, Any], study_name: str, retune: str) -> Optional[str]:
    """One line when a run of a study's pick measured samples/s outside the interval the study
    confirmed the pick at (its `figures`' throughput_lo..hi): the job, its data or the machine
    changed since, and `retune` (a command) tunes again from that study. None inside it, or
    without the figures to judge by."""
    figures = pick.get("figures") or {}
    lo, hi, got = figures.get("throughput_lo"), figures.get("throughput_hi"), result.get("throughput")
    if lo is None or hi is None or got is None or lo <= got <= hi:
        return None
    way = "below" if got < lo else "above"
    return (f"this run's {got:.1f} samples/s is {way} the interval study '{study_name}' confirmed its pick at "
            f"({lo:.1f} to {hi:.1f}): the job, its data or the machine changed since; re-tune from that study: {retune}")
