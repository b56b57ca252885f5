"""The tuning picture in user units (tuning.png, beside Optuna's plots): every measured trial's
throughput (real tokens/s, padding excluded, for tune.objective=tokens) against its utilization
(or its mfu, for tune.objective=mfu) with their 95% intervals, the throughput floor, the pruned,
refused, confirmed and baseline trials marked and the pick circled. The pick is the study's
decision as passed in (the trial best.yaml is written from); nothing here picks. The PNG carries
the pick's number as its `pick` text entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ..schema import Objective, TuneConfig
from .rules import completed, confirmed, figures, pickable, refused

FILE = "tuning.png"


def _axis(t: TuneConfig) -> tuple:
    """(figure key, label, scale) of the vertical axis."""
    if t.objective is Objective.mfu:
        return "mfu", "MFU (%)", 100.0
    return "utilization", "utilization (%)", 100.0


def _x_axis(t: TuneConfig) -> tuple:
    """(figure key, label) of the horizontal axis: the throughput the objective judges."""
    if t.objective is Objective.tokens:
        return "tokens_per_s", "real tokens/s (padding excluded)"
    return "throughput", "throughput (samples/s)"


def _errors(f: Dict[str, Any], key: str, scale: float) -> Optional[List[List[float]]]:
    lo, hi, mid = f.get(f"{key}_lo"), f.get(f"{key}_hi"), f.get(key)
    if lo is None or hi is None or mid is None:
        return None
    return [[scale * max(0.0, mid - lo)], [scale * max(0.0, hi - mid)]]


def _floor(study: Any, t: TuneConfig) -> Optional[float]:
    """The utilization objective's floor, in samples/s: tune.throughput_floor of the fastest
    possible pick, judged on the confirmed figures when there are (as rules.ranked reads it)."""
    if t.objective is not Objective.utilization:
        return None
    done = pickable(study, t)
    conf = confirmed(study)
    pool = [tr for tr in done if str(tr.number) in conf] or done
    return t.throughput_floor * max(figures(tr, conf)["throughput"] for tr in pool) if pool else None


def _pruned(study: Any, ax: Any, key: str, scale: float, x: str = "throughput") -> None:
    """Pruned trials at their last window's figures (their measurement was cut short)."""
    import optuna

    pts = [(tr.user_attrs[f"last_window_{x}"], tr.user_attrs.get(f"last_window_{key}"), tr.number)
           for tr in study.get_trials(deepcopy=False)
           if tr.state == optuna.trial.TrialState.PRUNED and f"last_window_{x}" in tr.user_attrs]
    pts = [p for p in pts if p[1] is not None]
    if pts:
        ax.scatter([p[0] for p in pts], [scale * p[1] for p in pts], marker="v", facecolors="none",
                   edgecolors="grey", label="pruned (last window)", zorder=2)
        for x, y, n in pts:
            ax.annotate(str(n), (x, scale * y), textcoords="offset points", xytext=(4, -10), fontsize=7, color="grey")


def write_picture(study: Any, best: List[Any], t: TuneConfig, out_dir: Path) -> Optional[Path]:
    """tuning.png in `out_dir`; `best` is the study's pick (best[0]), as best.yaml records it.
    None when no trial was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = completed(study)
    key, label, scale = _axis(t)
    x, x_label = _x_axis(t)
    done = [tr for tr in done if figures(tr, confirmed(study)).get(key) is not None
            and figures(tr, confirmed(study)).get(x) is not None]
    if not done:
        return None
    conf = confirmed(study)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = (("refused (one step per epoch)", lambda tr: refused(tr, t), "x", "tab:red"),
              ("confirmed (re-measured)", lambda tr: str(tr.number) in conf, "D", "tab:green"),
              ("baseline (the config as given)", lambda tr: tr.user_attrs.get("baseline"), "s", "tab:orange"),
              ("measured", lambda tr: True, "o", "tab:blue"))
    for name, test, marker, color in styles:
        group = [tr for tr in done if test(tr)]
        done = [tr for tr in done if tr not in group]
        for i, tr in enumerate(group):
            f = figures(tr, conf)
            ax.errorbar(f[x], scale * f[key], xerr=_errors(f, x, 1.0),
                        yerr=_errors(f, key, scale), fmt=marker, color=color, ecolor=color, alpha=0.85, capsize=3,
                        label=name if i == 0 else None, zorder=3)
            ax.annotate(str(tr.number), (f[x], scale * f[key]), textcoords="offset points", xytext=(5, 4),
                        fontsize=8)
    _pruned(study, ax, key, scale, x)
    floor = _floor(study, t)
    if floor is not None:
        ax.axvline(floor, color="tab:red", linestyle="--", linewidth=1,
                   label=f"throughput floor ({t.throughput_floor:g} x the fastest)")
    pick = best[0] if best else None
    if pick is not None:
        f = figures(pick, conf)
        ax.scatter([f[x]], [scale * f[key]], s=600, facecolors="none", edgecolors="black", linewidths=2,
                   label=f"the pick: trial {pick.number} (best.yaml)", zorder=4)
    ax.set_xlabel(x_label)
    ax.set_ylabel(label)
    ax.set_title(f"{len(completed(study))} measured trials, 95% intervals; objective {t.objective.value}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(out_dir) / FILE
    fig.savefig(path, dpi=80, metadata={"pick": "" if pick is None else str(pick.number)})
    plt.close(fig)
    return path
