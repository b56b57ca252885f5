"""The load report of a run: per-rank breakdown, imbalance, diagnosis with advice, profiler top
operators, memory; as `load_report.json`, `load_report.md` and PNG plots in the run dir."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List

from .diagnose import diagnose, straggler_note
from .runtime.autotune import LoaderSettings
from .measure.phases import PHASES
from .measure.results import JobResult, RankResult
from .rundir import report_paths, write_atomic, write_json
from .schema import Config

# The breakdown is that of the measured time (the full windows' phases summed), which tile its wall
# time; the only gap is the few microseconds between closing one window and starting the next.
SHARE_TOLERANCE = 0.01


def build(result: JobResult, cfg: Config, rank_results: List[RankResult]) -> Dict[str, Any]:
    """load_report.json: the job's figures, each measured rank's, the diagnosis (diagnose.py reads
    the job's figures as result.json has them) and the parts the run's hooks reported."""
    balance = result.balance or {}
    per_rank = []
    for r in rank_results:
        if not r.measured_steps:
            continue
        per_rank.append({
            "rank": r.rank, "host": r.get("host"), "device": r.get("device"),
            "utilization": r.utilization, "utilization_source": r.utilization_source,
            "throughput": r.throughput, "step_time_s": r.step_time_s,
            "phase_s": r.phase_s,
            "shares": {p: getattr(r, f"{p}_frac" if p != "data" else "data_wait_frac") for p in PHASES},
            "peak_mem_mb": r.get("peak_mem_mb"), "reserved_mem_mb": r.get("reserved_mem_mb"),
            "device_mem_mb": r.get("device_mem_mb"), "mem_source": r.get("mem_source"),
            "memory_summary": r.get("memory_summary"), "mfu": r.get("mfu"), "mfu_source": r.get("mfu_source"),
            "nvml_util": r.get("nvml_util"), "sm_active": r.get("sm_active"),
            # parallelism.balance=speed: this rank's share of the global batch, its own-work samples/s
            "share": balance["shares"][r.rank] if balance else None,
            "speed": balance["speeds"][r.rank] if balance.get("speeds") else None,
        })
    device_mem = min((r["device_mem_mb"] for r in per_rank if r.get("device_mem_mb")), default=None)
    tuned = result.loader_autotune
    if tuned:  # the advice is about the settings the run ended with
        cfg = dataclasses.replace(cfg, data=LoaderSettings(**tuned["final"]).data(cfg.data))
    figures = result.to_dict()
    diag = diagnose(figures, cfg, device_mem).as_dict()
    phase_sum = {r["rank"]: sum(r["phase_s"].values()) for r in per_rank}
    report: Dict[str, Any] = {
        "status": result.status,
        "backend": cfg.backend.name.value, "world_size": result.world_size,
        "diagnosis": diag,
        "straggler": straggler_note(figures),
        "imbalance": result.imbalance,
        "balance": balance or None,
        "job": {k: result.get(k) for k in ("utilization", "utilization_source", "throughput", "step_time_s",
                                            "data_wait_frac", "h2d_frac", "compute_frac", "comm_frac",
                                            "optimizer_frac", "other_frac", "peak_mem_mb", "mfu", "mfu_source",
                                            "nvml_util", "nvml_util_source", "sm_active", "sm_active_source",
                                            "tokens_per_s", "padding_frac")},
        "per_rank": per_rank,
        "share_check": {"tolerance": SHARE_TOLERANCE,
                        "phase_sum_over_step_time": {r["rank"]: phase_sum[r["rank"]] / r["step_time_s"] for r in per_rank}},
        "profile": next((r.get("profile") for r in rank_results if r.get("profile") and r.rank == 0), None),
        "loader_autotune": tuned,
        "validation": validation(result),
        "noise_scale": result.noise_scale.as_dict() if result.noise_scale else None,
    }
    return report


def validation(result: JobResult) -> Any:
    """The evaluations' part of the run (runtime/evaluate.py): their time, its share of the loop's
    wall time (kept out of the measured windows), the last validation loss; None without them."""
    if not result.evals:
        return None
    return {"evals": len(result.evals), "eval_s": result.eval_s, "eval_frac": result.eval_frac,
            "val_loss": result.val_loss, "val_metrics": result.val_metrics}


def validation_line(v: Dict[str, Any]) -> str:
    metrics = "".join(f", {k} {x:.4g}" for k, x in (v.get("val_metrics") or {}).items())
    share = f" ({100 * v['eval_frac']:.1f}% of the loop's wall time)" if v.get("eval_frac") is not None else ""
    return (f"{v['evals']} evaluation{'s' if v['evals'] != 1 else ''} took {v['eval_s']:.2f} s{share}, kept out of "
            f"the measured windows and the figures below; last validation loss {v['val_loss']:.4g}{metrics}")


def to_markdown(report: Dict[str, Any]) -> str:
    d = report["diagnosis"]
    lines = [f"# Load report ({report['backend']}, world size {report['world_size']})", "",
             f"**{d['verdict']}**: {d['reason']}.", ""]
    if d["advice"]:
        lines += ["What to try:", ""] + [f"- {a}" for a in d["advice"]] + [""]
    if report.get("straggler"):
        lines += [f"**Imbalance**: {report['straggler']}.", ""]
    if report.get("balance"):
        lines += [f"**Balance** (parallelism.balance=speed): {balance_line(report['balance'])}.", ""]
    if report.get("validation"):
        lines += [f"**Validation**: {validation_line(report['validation'])}.", ""]
    if report.get("noise_scale"):
        lines += [f"**Gradient noise scale**: {noise_line(report['noise_scale'])}.", ""]
    job = report["job"]
    if job.get("tokens_per_s") is not None:
        lines += [f"**Padding**: {100 * job['padding_frac']:.1f}% of the token positions computed were padding "
                  f"(attention_mask zeros); real tokens/s {job['tokens_per_s']:.0f}, beside "
                  f"{job['throughput']:.1f} samples/s.", ""]
    lines += ["| figure | value | source |", "|---|---|---|"]
    for key in ("utilization", "mfu", "nvml_util", "sm_active"):
        value = job.get(key)
        lines.append(f"| {key} | {'-' if value is None else f'{100 * value:.1f}%'} | {job.get(key + '_source') or '-'} |")
    lines.append("")
    bal = bool(report.get("balance"))
    lines += ["| rank | utilization | throughput | step ms | " + " | ".join(PHASES) + " | peak MB |"
              + (" share | own samples/s |" if bal else ""), "|---" * (5 + len(PHASES) + 2 * bal) + "|"]
    for r in report["per_rank"]:
        lines.append(f"| {r['rank']} | {100 * r['utilization']:.1f}% ({r['utilization_source']}) | {r['throughput']:.1f}/s | "
                     f"{1000 * r['step_time_s']:.2f} | " + " | ".join(f"{100 * r['shares'][p]:.1f}%" for p in PHASES)
                     + f" | {r['peak_mem_mb']:.0f} |"
                     + (f" {100 * r['share']:.1f}% | {_num(r['speed'], '.1f')} |" if bal else ""))
    lines += ["", "Phases are those of each rank's measured time per step (warmup excluded); they add up to "
                  f"its step time within {100 * report['share_check']['tolerance']:.0f}%."]
    lines += _autotune_markdown(report.get("loader_autotune"))
    prof = report.get("profile")
    if prof and prof.get("top_ops"):
        lines += ["", f"## Top operators (rank 0, {prof['steps']} profiled steps)", "",
                  "| operator | calls | self CPU ms | self device ms | input shapes |", "|---|---|---|---|---|"]
        for op in prof["top_ops"]:
            lines.append(f"| `{op['name']}` | {op['calls']} | {op['self_cpu_ms']:.3f} | {op['self_device_ms']:.3f} | "
                         f"{op['input_shapes']} |")
    for r in report["per_rank"]:
        if r.get("memory_summary"):
            lines += ["", f"## Memory, rank {r['rank']} ({r['device']})", "", "```", r["memory_summary"], "```"]
    return "\n".join(lines) + "\n"


def _autotune_markdown(tuned: Any) -> List[str]:
    """The loader autotune's events: one row per decision, with the steady throughput before and after."""
    if not tuned:
        return []
    start, final = LoaderSettings(**tuned["initial"]), LoaderSettings(**tuned["final"])
    lines = ["", "## Loader autotune", "", f"Started with {start.text}, ended with {final.text} "
             "(`tuned/loader.yaml`).", "", "| step | s | action | settings | before | throughput before | "
             "throughput after | noise | why |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for ev in tuned["events"]:
        if ev["action"] == "start":
            continue
        lines.append(f"| {ev['step']} | {ev['t_s']:.1f} | {ev['action']} | "
                     f"{LoaderSettings(ev['num_workers'], ev['prefetch_factor']).text} | "
                     f"{LoaderSettings(ev['from_workers'], ev['from_prefetch']).text} | {fmt(ev['throughput_before'])} | "
                     f"{fmt(ev['throughput_after'])} | {fmt(ev['noise'])} | {ev['reason']} |")
    return lines


def write_loader_override(tuned: Dict[str, Any], run_dir: Path) -> Path:
    """`tuned/loader.yaml`: the loader settings the autotune ended with, a Hydra override file as
    a study's best.yaml (`--config-dir RUN_DIR +tuned=loader`)."""
    import yaml

    from .commands import orchestrator_command

    out = run_dir / "tuned"
    out.mkdir(exist_ok=True)
    path = out / "loader.yaml"
    final = dict(tuned["final"])
    if final.get("num_workers") and final.get("prefetch_factor") is None:  # torch's default, said as the report says it
        final["prefetch_factor"] = LoaderSettings(final["num_workers"], None).effective_prefetch
    command = orchestrator_command(["--config-dir", str(run_dir), *_run_overrides(run_dir), "+tuned=loader"])
    write_atomic(path, "# @package _global_\n"
                    f"# The loader settings trainer.loader_autotune ended with ({LoaderSettings(**tuned['initial']).text} "
                    "at the start).\n"
                    + "".join(f"# {line}\n" for line in _last_try(tuned["events"]))
                    + f"# Use: {command}\n"
                    + yaml.safe_dump({"data": final}, sort_keys=True))
    return path


def _last_try(events: List[Dict[str, Any]]) -> List[str]:
    """What became of the autotune's last try: kept or reverted, and why (one line)."""
    tries = [i for i, ev in enumerate(events) if ev["action"] == "try"]
    if not tries:
        return []
    tried = events[tries[-1]]
    outcome = next((ev for ev in events[tries[-1] + 1:] if ev["action"] in ("keep", "revert")), None)
    what = LoaderSettings(tried["num_workers"], tried["prefetch_factor"]).text
    if outcome is None:  # a result written before LoaderTuner.finish resolved open trials
        return [f"Its last try, {what} at step {tried['step']}, was not judged"]
    said = "kept" if outcome["action"] == "keep" else "reverted"
    return [f"Its last try, {what} at step {tried['step']}, was {said} at step {outcome['step']}: {outcome['reason']}"]


def _run_overrides(run_dir: Path) -> List[str]:
    """The run's own command-line overrides (Hydra's .hydra/overrides.yaml), less those that
    would not rerun it: where it ran, a resume, the autotune itself and the loader's own keys."""
    import yaml

    try:
        given = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return []
    skip = ("hydra.", "trainer.resume=", "trainer.loader_autotune", "data.num_workers=", "data.prefetch_factor=")
    return [o for o in given if not o.lstrip("+~").startswith(skip)]


def _num(x: Any, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(scale * x, fmt)


def noise_line(noise: Dict[str, Any]) -> str:
    """The noise scale in words: B_simple with its interval, how and on how many steps it was measured."""
    how = {"ranks": "each rank's gradient before the all-reduce against the averaged one",
           "accumulation": "the first micro-batch's gradient against the accumulated one",
           "halves": "half a batch's gradient against the whole batch's"}.get(noise.get("method"), noise.get("method"))
    sizes = f"{how} ({noise.get('batch_small')} vs {noise.get('batch_big')} samples), {noise.get('n', 0)} steps"
    every, extra = noise.get("every"), noise.get("extra")
    if every:
        sizes += f" (one in {every} past the warmup"
        sizes += (f": an estimated step costs {extra:+.0%} of a step, ~{extra / every:.1%} of the step time)"
                  if extra is not None else ")")
    b = noise.get("b_simple")
    if b is None:
        return f"not measurable yet (the mean gradient's squared norm is not above its noise); {sizes}"
    lo, hi = noise.get("lo"), noise.get("hi")
    interval = f"95% interval {lo:.0f} to {hi:.0f}" if lo is not None and hi is not None else "no bounded interval yet"
    late, late_lo, late_hi = noise.get("b_late"), noise.get("late_lo"), noise.get("late_hi")
    late_interval = (f"95% interval {late_lo:.0f} to {late_hi:.0f}" if late_lo is not None and late_hi is not None
                     else "no bounded interval yet")
    late = (f"; {late:.0f} ({late_interval}) over the run's second half (from step {noise.get('late_from')}): "
            "the noise scale grows as the loss falls" if late is not None else "")
    return (f"B_simple = {b:.0f} samples ({interval}): batches much smaller than this gain almost linearly "
            f"from a larger batch, much larger ones little; from {sizes}{late}")


def balance_line(b: Dict[str, Any]) -> str:
    """The shares, the step time at the even split vs now, and how even the ranks' own work is at
    these shares (result.json's `balance`): a slower rank's smaller share is the balance, not a straggler."""
    shares = " / ".join(f"{100 * s:.0f}%" for s in b["shares"])
    even = _num(b.get("even_step_time_s"), ".2f", 1000)
    line = (f"shares {shares} of a global batch of {b['global_batch']} ({b['changes']} change"
            f"{'s' if b['changes'] != 1 else ''}); step time even split {even} ms "
            f"({b.get('even_step_time_source') or 'not measured'}) -> now {_num(b.get('step_time_s'), '.2f', 1000)} ms")
    line += f" ({b['speedup']:.2f}x)" if b.get("speedup") else ""
    own = b.get("own_window_s")
    if own and max(own) > 0:
        speeds = " / ".join(_num(v, ".0f") for v in b.get("speeds") or [])
        line += (f"; at these shares the ranks' own work per window is within {100 * (max(own) - min(own)) / max(own):.0f}% "
                 f"over {b.get('windows_at_shares')} windows" + (f" (own-work samples/s {speeds})" if speeds else ""))
    return line


def make_plots(rank_results: List[RankResult], out_dir: Path) -> List[Path]:
    """Utilization and data-wait timeline per rank; stacked step-time breakdown per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r for r in rank_results if r.windows_detail]
    if not ranks:
        return []
    made = []
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in ranks:
        wins = r.windows_detail
        t0 = wins[0].t_start
        xs = [w.t_end - t0 for w in wins]
        total = [sum(w.phases_s.values()) or 1.0 for w in wins]
        ax.plot(xs, [100 * w.utilization for w in wins], marker="o", label=f"rank {r.rank} utilization")
        ax.plot(xs, [100 * w.phases_s["data"] / tot for w, tot in zip(wins, total)], linestyle="--",
                marker="x", label=f"rank {r.rank} data wait")
    ax.set_xlabel("seconds since the first step (window ends; warmup windows included)")
    ax.set_ylabel("% of window")
    ax.set_ylim(0, 100)
    ax.set_title("Utilization and data wait per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "timeline.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    made.append(path)

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(ranks) + 3), 4))
    bottom = [0.0] * len(ranks)
    labels = [f"rank {r.rank}" for r in ranks]
    for phase in PHASES:
        vals = [1000 * r.phase_s[phase] for r in ranks]  # type: ignore[index]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step (over the measured time)")
    ax.set_title("Step-time breakdown per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "breakdown.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    made.append(path)
    return made


def write(result: JobResult, cfg: Config, rank_results: List[RankResult], run_dir: Path,
          plots: bool = True) -> tuple:
    """Writes the report files (and, with `plots`, the PNGs); returns (report, [paths])."""
    report = build(result, cfg, rank_results)
    as_json, as_md = report_paths(run_dir)
    paths = [write_json(as_json, report, indent=2), write_atomic(as_md, to_markdown(report))]
    if not plots:
        return report, paths
    try:
        paths += make_plots(rank_results, run_dir)
    except Exception as exc:  # a plot must never cost the run its result
        print(f"[report] no plots: {exc}")
    return report, paths
