"""The typed results of a measurement and their JSON form: a rank's `Window`, the `WindowFigures`
of a window (a rank's, or the job's by `job_window`), an `Estimate`, a rank's result
(`RankResult`, ranks/rank<R>.json) and the job's (`JobResult`, result.json).

The JSON keys are those the files have always had (MLflow metrics, trials.csv, the UI and the docs
name them); a file now also says its `schema_version`. Reading is lenient: a file written before
typed results (no `schema_version`, fields added since missing) loads, and every key a class does
not type travels in its `extra`, as written. Pure: nothing here imports torch or another floor."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar, overload

# 1: typed results. A file without `schema_version` (0) was written before them, with the same keys.
SCHEMA_VERSION = 1


def _measured(default: Any = None) -> Any:
    """A figure of the measured block: written (nulls included) once something was measured."""
    return field(default=default, metadata={"measured": True})


class _Record:
    """to_dict/from_dict for the results below: typed fields by name, every other key in `extra`.
    A field is written when it is not None; a measured figure also as null once the result
    measured something (`measured_steps`), as the files have always had it."""

    _nested: ClassVar[Dict[str, Any]] = {}  # field -> (from_json, to_json)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        names = {f.name for f in fields(cls)} - {"extra"}  # type: ignore[arg-type]
        typed: Dict[str, Any] = {}
        for k, v in d.items():
            if k in names and v is not None:
                typed[k] = cls._nested[k][0](v) if k in cls._nested else v
        extra = {k: v for k, v in d.items() if k not in names and k != "schema_version"}
        return cls(**typed, extra=extra)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        measured = bool(getattr(self, "measured_steps", 0))
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.name == "extra" or (v is None and not (measured and f.metadata.get("measured"))):
                continue
            out[f.name] = self._nested[f.name][1](v) if f.name in self._nested and v is not None else v
        out.update(self.extra)  # type: ignore[attr-defined]
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """A key of the JSON record, typed or not (`default` when absent or null)."""
        v = getattr(self, key) if key in {f.name for f in fields(self)} else self.extra.get(key)  # type: ignore
        return default if v is None else v


T = TypeVar("T")


class Kept(Generic[T]):
    """A key of a record's `extra` read and set as a typed attribute (`job.error = ...`): kept in
    `extra` as written, so that a null set stays null in the file and the keys keep the order they
    were set in, as the files have always had them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    @overload
    def __get__(self, obj: None, owner: Optional[type] = None) -> "Kept[T]": ...
    @overload
    def __get__(self, obj: Any, owner: Optional[type] = None) -> T: ...

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else obj.extra.get(self.key)

    def __set__(self, obj: Any, value: T) -> None:
        obj.extra[self.key] = value


# -- windows --------------------------------------------------------------------------------------
@dataclass
class Window:
    """One window of a rank's measurement (runtime/meter.StepMeter closes them)."""

    index: int
    first_step: int
    steps: int
    samples: int
    wall_s: float
    phases_s: Dict[str, float]
    utilization: float
    t_start: float  # perf_counter, for timelines
    t_end: float
    sm_active: Optional[float] = None  # NVML GPM SM activity (Hopper and newer)
    # CPU only: the process's CPU time in each phase (on fast steps estimated from a sample of the steps:
    # runtime/windows.py cpu_by_phase)
    phases_cpu_s: Optional[Dict[str, float]] = None
    busy_cpu_s: Optional[float] = None  # CPU only: the loop thread's CPU time in compute + optimizer
    warmup: bool = False
    partial: bool = False  # cut short (the run's end, a new epoch): left out of the estimate
    tokens: int = 0  # dict batches with an attention_mask: the real tokens (mask ones) in the window
    padded_tokens: int = 0  # and every position computed (the mask's size): real + padding

    @property
    def throughput(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def share(self, phase: str) -> float:
        total = sum(self.phases_s.values())
        return self.phases_s.get(phase, 0.0) / total if total > 0 else 0.0

    def figures(self) -> "WindowFigures":
        """This rank's figures of the window (what job_window aggregates over the ranks)."""
        return WindowFigures(throughput=self.throughput, step_time_s=self.wall_s / self.steps if self.steps else 0.0,
                             utilization=self.utilization, data_wait_frac=self.share("data"),
                             comm_frac=self.share("comm"), wall_s=self.wall_s,
                             tokens_per_s=self.tokens / self.wall_s if self.padded_tokens and self.wall_s > 0 else None,
                             step=self.first_step + self.steps, warmup=self.warmup, partial=self.partial)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "index": self.index, "first_step": self.first_step, "steps": self.steps, "samples": self.samples,
            "wall_s": self.wall_s, "throughput": self.throughput, "utilization": self.utilization,
            "phases_s": self.phases_s, "t_start": self.t_start, "t_end": self.t_end, "sm_active": self.sm_active,
            "warmup": self.warmup, "partial": self.partial, "phases_cpu_s": self.phases_cpu_s,
            "busy_cpu_s": self.busy_cpu_s, "tokens": self.tokens, "padded_tokens": self.padded_tokens,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Window":
        """A window record of rank<R>.json (`windows_detail`); keys added since default."""
        wall = float(d.get("wall_s") or 0.0)
        samples = d.get("samples")
        if samples is None:  # only its rate recorded
            samples = round(float(d.get("throughput") or 0.0) * wall)
        return cls(index=int(d.get("index", 0)), first_step=int(d.get("first_step", 0)), steps=int(d.get("steps", 0)),
                   samples=samples, wall_s=wall, phases_s=dict(d.get("phases_s") or {}),
                   utilization=float(d.get("utilization") or 0.0), t_start=float(d.get("t_start", 0.0)),
                   t_end=float(d.get("t_end", 0.0)), sm_active=d.get("sm_active"), phases_cpu_s=d.get("phases_cpu_s"),
                   busy_cpu_s=d.get("busy_cpu_s"), warmup=bool(d.get("warmup")), partial=bool(d.get("partial")),
                   tokens=int(d.get("tokens") or 0), padded_tokens=int(d.get("padded_tokens") or 0))


@dataclass(frozen=True)
class WindowFigures:
    """A window's figures: one rank's (Window.figures, a window event) or the job's (job_window)."""

    throughput: float  # samples/s
    step_time_s: float
    utilization: float
    data_wait_frac: float
    comm_frac: float
    wall_s: float = 0.0  # 0: not known (a window event)
    tokens_per_s: Optional[float] = None  # real tokens/s: batches with an attention_mask, else None
    step: int = 0  # the step the window closed at
    warmup: bool = False
    partial: bool = False

    # what the ranks exchange (runtime/loop.Run.job_figures): one all-reduce of these per window
    PACKED: ClassVar[Tuple[str, ...]] = ("throughput", "step_time_s", "utilization", "data_wait_frac", "comm_frac",
                                         "wall_s", "tokens_per_s")
    # the window metrics the live log writes to MLflow (the job's; each rank's as rank<R>/<name>)
    METRICS: ClassVar[Tuple[str, ...]] = ("throughput", "utilization", "data_wait_frac", "comm_frac", "step_time_s",
                                          "tokens_per_s")

    def packed(self) -> List[float]:
        """As floats (no tokens counted: -1)."""
        return [float(-1.0 if v is None else v) for v in (getattr(self, k) for k in self.PACKED)]

    @classmethod
    def unpacked(cls, values: Sequence[float]) -> "WindowFigures":
        d = dict(zip(cls.PACKED, values))
        d["tokens_per_s"] = d["tokens_per_s"] if d["tokens_per_s"] >= 0 else None
        return cls(**d)

    @classmethod
    def from_event(cls, ev: Mapping[str, Any]) -> "WindowFigures":
        """A rank's window event (rundir.WindowEvent)."""
        tokens = ev.get("tokens_per_s")
        return cls(throughput=float(ev["throughput"]), step_time_s=float(ev["step_time_s"]),
                   utilization=float(ev["utilization"]), data_wait_frac=float(ev["data_wait_frac"]),
                   comm_frac=float(ev["comm_frac"]), tokens_per_s=None if tokens is None else float(tokens),
                   step=int(ev.get("step", 0)), wall_s=float(ev.get("wall_s") or 0.0))

    def metrics(self) -> Dict[str, float]:
        """The MLflow window metrics (tokens/s only where counted)."""
        return {k: getattr(self, k) for k in self.METRICS if getattr(self, k) is not None}


def job_window(ranks: Sequence[WindowFigures]) -> WindowFigures:
    """The job's window i from every rank's window i (the ranks close windows at the same steps).
    The one definition the stop rule (runtime/loop), the live log and its pruner (livelog.LiveLog)
    and the merged result (merge.job_windows, the tuner's estimates) read:

    - throughput and real tokens/s: the ranks' summed (the job's samples over the window; tokens
      only where every rank counted them);
    - step time and wall time: the slowest rank's (the ranks wait for each other every step);
    - utilization, data wait and communication shares: the ranks' mean."""
    if not ranks:
        raise ValueError("job_window: no rank's window")
    tokens = [r.tokens_per_s for r in ranks]
    return WindowFigures(
        throughput=sum(r.throughput for r in ranks),
        step_time_s=max(r.step_time_s for r in ranks),
        utilization=statistics.fmean(r.utilization for r in ranks),
        data_wait_frac=statistics.fmean(r.data_wait_frac for r in ranks),
        comm_frac=statistics.fmean(r.comm_frac for r in ranks),
        wall_s=max(r.wall_s for r in ranks),
        tokens_per_s=sum(tokens) if all(t is not None for t in tokens) else None,  # type: ignore[misc]
        step=max(r.step for r in ranks), warmup=ranks[0].warmup, partial=any(r.partial for r in ranks))


def pooled_in_time(windows: Sequence[WindowFigures]) -> WindowFigures:
    """Consecutive windows of one job (or one rank) as one: throughput, real tokens/s and the shares
    weighted by each window's seconds, the step time their seconds over their steps, the last
    window's step. What the live log writes to MLflow where windows are shorter than its points."""
    if not windows:
        raise ValueError("pooled_in_time: no window")
    wall = sum(w.wall_s for w in windows)
    if wall <= 0:  # seconds not known: the last window stands for them
        return windows[-1]

    def mean(k: str) -> float:
        return sum(getattr(w, k) * w.wall_s for w in windows) / wall

    steps = sum(w.wall_s / w.step_time_s for w in windows if w.step_time_s > 0)
    tokens = [w.tokens_per_s for w in windows]
    return WindowFigures(
        throughput=mean("throughput"), step_time_s=wall / steps if steps else windows[-1].step_time_s,
        utilization=mean("utilization"), data_wait_frac=mean("data_wait_frac"), comm_frac=mean("comm_frac"),
        wall_s=wall, tokens_per_s=sum(t * w.wall_s for t, w in zip(tokens, windows)) / wall  # type: ignore[operator]
        if all(t is not None for t in tokens) else None, step=windows[-1].step)


# -- estimates ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A figure's estimate over windows (measure.stats.estimate): its mean, relative standard
    error, 95% interval, the windows used and their measured seconds."""

    mean: Optional[float] = None
    rel_se: Optional[float] = None
    interval: Optional[Tuple[float, float]] = None
    windows: int = 0
    measured_s: float = 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Estimate":
        iv = d.get("interval")
        return cls(mean=d.get("mean"), rel_se=d.get("rel_se"), interval=(float(iv[0]), float(iv[1])) if iv else None,
                   windows=int(d.get("windows") or 0), measured_s=float(d.get("measured_s") or 0.0))

    def as_dict(self) -> Dict[str, Any]:
        return {"mean": self.mean, "rel_se": self.rel_se, "interval": list(self.interval) if self.interval else None,
                "windows": self.windows, "measured_s": self.measured_s}


@dataclass
class NoiseScale:
    """The run's gradient noise scale (measure/noise.py): B_simple = tr(Sigma) / |G|^2 and its 95%
    interval (None: not measurable yet, or unbounded), the means of the unbiased |G|^2 and
    tr(Sigma), the steps estimated, how (`ranks`: each rank's gradient before the all-reduce and
    the averaged one after; `accumulation`: the first micro-batch's and the accumulated;
    `halves`: two halves of a batch every measure.noise_every steps) and the two batch sizes;
    `b_late`: B_simple over the run's second half from step `late_from` (None: too few steps there),
    its 95% interval `late_lo` to `late_hi` (None where unbounded); `every`: the cadence as last
    decided (every `every`-th step estimated besides the warmup's; 0: the warmup's only), and `extra`: an
    estimated step's extra wall time over an ordinary step's, as a fraction of the ordinary one, that
    measure.noise_every=0 set it by (None: not timed; extra / every is the estimates' share of the
    step time)."""

    b_simple: Optional[float] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    g2: Optional[float] = None
    trace_sigma: Optional[float] = None
    n: int = 0
    method: str = "halves"
    batch_small: int = 0
    batch_big: int = 0
    b_late: Optional[float] = None
    late_from: int = 0
    late_lo: Optional[float] = None
    late_hi: Optional[float] = None
    every: int = 0
    extra: Optional[float] = None

    METHODS: ClassVar[Tuple[str, ...]] = ("ranks", "accumulation", "halves")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NoiseScale":
        num = lambda k: None if d.get(k) is None else float(d[k])  # noqa: E731
        return cls(b_simple=num("b_simple"), lo=num("lo"), hi=num("hi"), g2=num("g2"),
                   trace_sigma=num("trace_sigma"), n=int(d.get("n") or 0), method=str(d.get("method") or "halves"),
                   batch_small=int(d.get("batch_small") or 0), batch_big=int(d.get("batch_big") or 0),
                   b_late=num("b_late"), late_from=int(d.get("late_from") or 0), late_lo=num("late_lo"),
                   late_hi=num("late_hi"), every=int(d.get("every") or 0), extra=num("extra"))

    def as_dict(self) -> Dict[str, Any]:
        return {"b_simple": self.b_simple, "lo": self.lo, "hi": self.hi, "g2": self.g2,
                "trace_sigma": self.trace_sigma, "n": self.n, "method": self.method,
                "batch_small": self.batch_small, "batch_big": self.batch_big, "b_late": self.b_late,
                "late_from": self.late_from, "late_lo": self.late_lo, "late_hi": self.late_hi,
                "every": self.every, "extra": self.extra}


_ESTIMATE = (Estimate.from_dict, Estimate.as_dict)
_NOISE = (NoiseScale.from_dict, NoiseScale.as_dict)
_WINDOWS = (lambda ws: [Window.from_dict(w) for w in ws], lambda ws: [w.as_dict() for w in ws])


# -- a rank's result, the job's -------------------------------------------------------------------
@dataclass
class RankResult(_Record):
    """ranks/rank<R>.json: what a rank measured (rank.run_one writes it, merge reads it). The
    typed fields are those the merge reads; the rest (host, device, memory, warmup, mfu, the
    hooks' parts: balance, loader_autotune, profile) travel in `extra` as written."""

    rank: int = 0
    steps: int = 0
    measured_steps: int = 0  # steps in measured windows (0: nothing measured; the figures absent)
    utilization_source: str = "-"
    steps_per_epoch: Optional[int] = None
    peak_mem_mb: Optional[float] = None
    utilization: Optional[float] = _measured()
    throughput: Optional[float] = _measured()  # samples/s over the measured time
    step_time_s: Optional[float] = _measured()
    data_wait_frac: Optional[float] = _measured()
    h2d_frac: Optional[float] = _measured()
    compute_frac: Optional[float] = _measured()
    comm_frac: Optional[float] = _measured()
    optimizer_frac: Optional[float] = _measured()
    other_frac: Optional[float] = _measured()
    busy_frac: Optional[float] = _measured()
    phase_s: Optional[Dict[str, float]] = _measured()  # seconds per step in each phase
    tokens_per_s: Optional[float] = _measured()
    padding_frac: Optional[float] = _measured()
    estimate: Optional[Estimate] = _measured()  # the throughput's over full windows
    windows_detail: List[Window] = field(default_factory=list)  # warmup windows included
    extra: Dict[str, Any] = field(default_factory=dict)

    _nested: ClassVar[Dict[str, Any]] = {"estimate": _ESTIMATE, "windows_detail": _WINDOWS}

    def window_figures(self) -> List[WindowFigures]:
        """This rank's measured windows' figures (warmup windows left out), in order."""
        return [w.figures() for w in self.windows_detail if not w.warmup]


# the fields every rank reports and result.json's `per_rank` repeats (None where a rank has none)
PER_RANK_FIELDS = (
    "rank", "host", "device", "param_digest", "steps", "first_loss", "final_loss", "utilization", "utilization_source",
    "throughput", "step_time_s", "data_wait_frac", "h2d_frac", "compute_frac", "comm_frac", "optimizer_frac",
    "other_frac", "phase_s", "peak_mem_mb", "reserved_mem_mb", "model_state_mb", "start_mem_mb", "device_mem_mb",
    "mem_source", "measured_steps",
    "warmup_excluded", "utilization_spread", "throughput_spread", "mfu", "mfu_source", "mfu_dtype",
    "flops_per_sample", "peak_flops", "nvml_util", "nvml_util_source", "sm_active", "sm_active_source", "busy_frac",
    "input_cost",
)


@dataclass
class JobResult(_Record):
    """result.json: the job's result (merge.merge, completed by finish.settle). Typed: what the
    summary, the tuner and a resume read; the rest (the device figures, input_cost, the
    diagnosis, balance, loader_autotune, the MLflow run, errors) travels in `extra` as written."""

    status: Optional[str] = None
    backend: Optional[str] = None
    world_size: Optional[int] = None
    steps: Optional[int] = None
    steps_per_epoch: Optional[int] = None
    measured_steps: Optional[int] = None  # the least over the ranks that measured; absent: none did
    utilization: Optional[float] = _measured()  # the ranks' mean
    utilization_source: Optional[str] = _measured()
    throughput: Optional[float] = _measured()  # samples/s, summed over ranks
    step_time_s: Optional[float] = _measured()  # the slowest rank's
    data_wait_frac: Optional[float] = _measured()  # the shares: the ranks' mean
    h2d_frac: Optional[float] = _measured()
    compute_frac: Optional[float] = _measured()
    comm_frac: Optional[float] = _measured()
    optimizer_frac: Optional[float] = _measured()
    busy_frac: Optional[float] = _measured()
    other_frac: Optional[float] = _measured()
    peak_mem_mb: Optional[float] = _measured()  # the largest rank's
    tokens_per_s: Optional[float] = _measured()  # real tokens/s, summed
    padding_frac: Optional[float] = _measured()
    estimate: Optional[Estimate] = _measured()  # the throughput's, over the job's windows (job_window)
    utilization_estimate: Optional[Estimate] = _measured()
    tokens_estimate: Optional[Estimate] = None  # batches with an attention_mask only
    imbalance: Optional[Dict[str, Any]] = _measured()
    per_rank: Optional[List[Dict[str, Any]]] = None  # PER_RANK_FIELDS of each rank
    # validation (runtime/evaluate.py): the last evaluation's loss and metrics, every evaluation
    # ({step, epoch, samples, wall_s, eval_s, val_loss, val/<metric>}), their time and share of the loop's
    val_loss: Optional[float] = None
    val_metrics: Optional[Dict[str, float]] = None
    evals: Optional[List[Dict[str, Any]]] = None
    eval_s: Optional[float] = None
    eval_frac: Optional[float] = None
    # trainer.target_loss: reached or not; when reached, the loop's wall time (evaluations included)
    # and the global samples to the evaluation (or log interval) that reached it
    target_loss: Optional[float] = None
    target_reached: Optional[bool] = None
    time_to_target_s: Optional[float] = None
    samples_to_target: Optional[float] = None
    noise_scale: Optional[NoiseScale] = None  # the gradient noise scale (measure.noise_scale)
    extra: Dict[str, Any] = field(default_factory=dict)

    # the keys every rank reports alike (all-reduced figures; rank 0's timing) that merge copies
    VALIDATION: ClassVar[Tuple[str, ...]] = ("val_loss", "val_metrics", "evals", "eval_s", "eval_frac", "target_loss",
                                             "target_reached", "time_to_target_s", "samples_to_target")

    _nested: ClassVar[Dict[str, Any]] = {"estimate": _ESTIMATE, "utilization_estimate": _ESTIMATE,
                                         "tokens_estimate": _ESTIMATE, "noise_scale": _NOISE}

    # (figure, its estimate's field): the figures a trial and its confirmation runs keep with intervals
    ESTIMATES: ClassVar[Tuple[Tuple[str, str], ...]] = (
        ("throughput", "estimate"), ("utilization", "utilization_estimate"), ("tokens_per_s", "tokens_estimate"))

    # the parent's part (app, finish): where the job ran and is tracked, how it ended
    mlflow_run_id = Kept[Optional[str]]()
    run_dir = Kept[Optional[str]]()
    mlflow = Kept[Optional[str]]()  # where to see the run (Tracker.where)
    wall_s = Kept[Optional[float]]()  # the job's, launch to merge
    error = Kept[Optional[str]]()
    checkpointed_at_step = Kept[Optional[int]]()
    requeue = Kept[Optional[str]]()  # the SLURM job to requeue, or None
    diagnosis = Kept[Optional[Dict[str, Any]]]()  # the load report's (diagnose.Diagnosis.as_dict)
    bottleneck = Kept[Optional[str]]()
    straggler = Kept[Optional[str]]()
    # what the ranks report alike, that the parent and the tuner read (merge copies rank 0's)
    stopped_by = Kept[Optional[str]]()
    loader_autotune = Kept[Optional[Dict[str, Any]]]()
    balance = Kept[Optional[Dict[str, Any]]]()
    time_s = Kept[Optional[Dict[str, float]]]()  # the ranks' loops: train, setup, warmup seconds
    mfu = Kept[Optional[float]]()
    mfu_source = Kept[Optional[str]]()
    input_cost = Kept[Optional[Dict[str, Any]]]()
    item_bytes = Kept[Optional[float]]()

    def to_dict(self) -> Dict[str, Any]:
        """As result.json has always had it: where the job runs and is tracked right after its
        status and backend (written first, when the job started), then the figures."""
        out = super().to_dict()
        lead = [k for k in ("schema_version", "status", "backend", "mlflow_run_id", "run_dir", "mlflow") if k in out]
        return {**{k: out[k] for k in lead}, **out}

    def absorb(self, merged: "JobResult") -> None:
        """The ranks' merged result (merge.merge) into this record of the job: every figure it
        has, and its untyped keys after the parent's own; the parent's status and backend stay."""
        for f in fields(self):
            value = getattr(merged, f.name)
            if f.name == "extra":
                self.extra.update(value)
            elif value is not None:
                setattr(self, f.name, value)
