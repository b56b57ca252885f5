#!/usr/bin/env bash
# The GPU check: one script, under 8 minutes on a one-GPU machine whose Python already has torch
# with CUDA (and nvidia-ml-py, psutil, rich, pyyaml, matplotlib) but not hydra-core, omegaconf or
# optuna: those are installed from the wheels in WHEELS (made by scripts/gpu_wheels.sh, see the
# docs/measurement.md, "GPU check"). MLflow is not needed: every job runs with tracking.enabled=false.
#
# It runs single, dp, ddp and fsdp (1 rank, NCCL; fsdp with AMP's mixed-precision policy and a
# sharded checkpoint) jobs of a transformer LM, AMP bf16 and fp16, the
# profiler with the CUDA memory summary, validation (fsdp, AMP), 2 ddp ranks on the GPU over gloo
# and a run without the gradient noise scale (its value per method and its cost), a 4-trial study
# and a 4-trial goodput study (the global batch freed), then prints one table: what ran, its
# status, mfu, nvml_util, sm_active, peak memory and throughput. Outputs go to OUT.
#   bash bench/gpu_check.sh [WHEELS=.whl] [OUT=/tmp/gpu_check]
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
OUT=${2:-/tmp/gpu_check}
PY=${PY:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
mkdir -p "$OUT"
if ! "$PY" -c "import hydra, omegaconf, optuna" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "gpu_check: could not install the wheels in $WHEELS (bash scripts/gpu_wheels.sh makes them)"; exit 2; }
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1  # `-m orchestrator` from the repository root: it and its ranks import the project from it
DEVICE=${GPU_CHECK_DEVICE:-cuda}  # cpu: a smoke test of this script on a machine without a GPU
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 2
  # a transformer large enough to load a GPU: d_model 1024, 8 layers, 256 tokens
  SIZE=(model.args.d_model=1024 model.args.n_heads=16 model.args.n_layers=8 model.args.seq_len=256 model.args.vocab=8192
        data.args.seq_len=256 data.args.vocab=8192 data.args.size=8192 data.batch_size=32 trainer.max_steps=120)
else
  SIZE=(data.batch_size=8 trainer.max_steps=30)
fi
LM=(experiment=transformer_lm "${SIZE[@]}" backend.device=$DEVICE tracking.enabled=false trainer.save_model=false
    measure.warmup_steps=10 measure.window_steps=10)
run() {  # name, overrides...
  local name=$1; shift
  echo "== $name"
  timeout 240 "$PY" -m orchestrator "${LM[@]}" "$@" "hydra.run.dir=$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "   exit $? ($(tail -n 1 "$OUT/$name.log" | cut -c1-120))"
}
run single backend=single
run dp backend=dp
run ddp_nccl backend=ddp parallelism.nproc_per_node=1 backend.dist_backend=nccl
run fsdp_amp backend=fsdp parallelism.nproc_per_node=1 backend.dist_backend=nccl trainer.amp=true trainer.checkpoint_every=50
run amp_bf16 trainer.amp=true trainer.amp_dtype=bf16
run amp_fp16 trainer.amp=true trainer.amp_dtype=fp16
run profiler trainer.amp=true measure.profile_steps=5
# validation under fsdp with AMP: 5% held out, an evaluation every 40 steps and at the end, kept out of the windows
run validation backend=fsdp parallelism.nproc_per_node=1 backend.dist_backend=nccl trainer.amp=true \
  data.val_fraction=0.05 trainer.eval_every=40
# the gradient noise scale on CUDA: 2 ranks on the one GPU (gloo), the DDP hook's method; its cost beside `single`
run ddp_gloo_2 backend=ddp parallelism.nproc_per_node=2 backend.dist_backend=gloo
run single_quiet backend=single measure.noise_scale=false
run study mode=tune tune.n_trials=4 measure.warmup_steps=5 measure.trial_steps=20 measure.window_steps=5 \
  "tune.storage=sqlite:///$OUT/optuna.db" tune.space.batch_size.low=8 tune.space.batch_size.high=64 \
  tune.space.num_workers.high=2 tune.space.accumulation_steps.high=2
# the global batch freed, ranked by goodput: the learning rate that follows it, what a sample is worth
run goodput mode=tune tune.global_batch=free tune.objective=goodput tune.n_trials=4 measure.warmup_steps=5 \
  measure.trial_steps=20 measure.window_steps=5 "tune.storage=sqlite:///$OUT/optuna.db" tune.space.batch_size.low=8 \
  tune.space.batch_size.high=64 tune.space.num_workers.high=2 tune.space.accumulation_steps.high=2

"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [("run", "status", "mfu", "nvml_util", "sm_active", "peak MB", "samples/s", "verdict")]
pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
for name in ("single", "dp", "ddp_nccl", "fsdp_amp", "amp_bf16", "amp_fp16", "profiler", "validation"):
    path = out / name / "result.json"
    r = json.loads(path.read_text()) if path.exists() else {"status": "NO RESULT"}
    rows.append((name, r.get("status"), pct(r.get("mfu")), pct(r.get("nvml_util")), pct(r.get("sm_active")),
                 f"{r['peak_mem_mb']:.0f}" if r.get("peak_mem_mb") else "-",
                 f"{r['throughput']:.0f}" if r.get("throughput") else "-", r.get("bottleneck", "-")))
summary = out / "study" / "summary.json"
if summary.exists():
    s = json.loads(summary.read_text())
    b = s.get("best") or {}
    rows.append(("study (4 trials)", str(s.get("states")), pct(b.get("mfu")), "-", "-",
                 f"{b['peak_mem_mb']:.0f}" if b.get("peak_mem_mb") else "-",
                 f"{b['throughput']:.0f}" if b.get("throughput") else "-",
                 " ".join(f"{k.split('.')[-1]}={v}" for k, v in (b.get("values") or {}).items())))
else:
    rows.append(("study (4 trials)", "NO SUMMARY", "-", "-", "-", "-", "-", "-"))
goodput = out / "goodput" / "summary.json"
tt = json.loads(goodput.read_text()).get("time_to_target") or {} if goodput.exists() else {}
print(f"goodput study: {tt.get('line') or tt.get('guard') or 'the pick trains your global batch'}; lr {tt.get('lr')} "
      f"({tt.get('rule_used')}); noise scale {(tt.get('noise_scale') or {}).get('how', 'not measured')}"
      if goodput.exists() else "goodput study: NO SUMMARY")
prof = out / "profiler" / "load_report.json"
if prof.exists():
    rep = json.loads(prof.read_text())
    ops = (rep.get("profile") or {}).get("top_ops") or []
    has_mem = any(r.get("memory_summary") for r in rep.get("per_rank", []))
    print(f"profiler: {len(ops)} top ops, first {ops[0]['name'] if ops else '-'}; memory summary: {has_mem}")
val = out / "validation" / "result.json"
if val.exists():
    v = json.loads(val.read_text())
    print(f"validation: {len(v.get('evals') or [])} evaluations at steps {[e['step'] for e in v.get('evals') or []]}, "
          f"val_loss {v.get('val_loss')}, eval_frac {pct(v.get('eval_frac'))} of the loop (kept out of the windows)")
for name in ("single", "ddp_nccl", "fsdp_amp", "amp_fp16", "ddp_gloo_2"):  # the gradient noise scale, per method
    path = out / name / "result.json"
    ns = (json.loads(path.read_text()).get("noise_scale") if path.exists() else None) or {}
    print(f"noise scale {name}: " + (f"B_simple {ns.get('b_simple')} [{ns.get('lo')}, {ns.get('hi')}] ({ns['method']}, "
                                     f"{ns.get('batch_small')} vs {ns.get('batch_big')}, {ns['n']} steps)" if ns.get("n")
                                     else "not measured (one rank without accumulation, or no result)"))
step = {n: json.loads((out / n / "result.json").read_text()).get("step_time_s")
        for n in ("single", "single_quiet") if (out / n / "result.json").exists()}
if len(step) == 2 and all(step.values()):
    print(f"noise scale cost (single vs single_quiet step time): {100 * (step['single'] / step['single_quiet'] - 1):+.2f}%")
widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
for i, r in enumerate(rows):
    print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if i == 0:
        print("  ".join("-" * w for w in widths))
PY
