#!/usr/bin/env bash
# The ft_launcher safety features this repo cannot exercise on its CPU-only machines, run for real on one GPU node
# with nvidia-resiliency-ext >= 0.7 installed (a cluster container): GPU memory reclaim between restarts (needs
# NVML) and NUMA binding (needs numactl and a multi-NUMA node). The job is set up by FaultTolerancePlugin through
# run.run on the LocalExecutor; the trainer is examples/argparse_trainer.py failing its first cycle, so one
# restart happens. (The node health service check needs the sbatch script: submit any job with
# FaultTolerancePlugin(node_health_check_endpoint="unix:///var/run/nvhcd.sock") on a node that runs the service.)
#
# Usage (from the repo root, on the GPU node): scripts/nvrx_releases/prove_features_on_gpu_node.sh [OUT_DIR]
# Then read OUT_DIR/report.txt: the lines ft_launcher logged for each feature (GPU memory checks after the failed
# cycle, the numactl command it wrapped each rank in).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-/tmp/mr-nvrx-features}")
PY=${PY:-python3}
mkdir -p "$OUT"
export NEMORUN_HOME="$OUT/home"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" - "$OUT" "$GPUS" <<'PYEOF'
import json, sys
from megatron_resilience.upstream import import_nemo_run
run = import_nemo_run()
from megatron_resilience.plugins import FaultTolerancePlugin, megatron_lm_args

out, gpus = sys.argv[1], int(sys.argv[2])
features = dict(gpu_memory_reclaim_timeout=60.0, gpu_memory_tolerance_mb=512.0, gpu_memory_poll_interval=1.0,
                gpus_per_numa=max(1, gpus // 2), numa_bind_strict=True, per_cycle_logs=True, cycle_info=True)
task = run.Script(path="examples/argparse_trainer.py", entrypoint="python",
                  args=["--train-iters", "20", "--save", f"{out}/ckpt", "--report", f"{out}/report.jsonl",
                        "--fail-first-cycle"])
plugin = FaultTolerancePlugin(nvrx_version="0.7", enable_ft_package=False, script_args_converter_fn=megatron_lm_args,
                              **features)
run.run(task, executor=run.LocalExecutor(ntasks_per_node=gpus, launcher="ft"), name="features", plugins=[plugin])
print(json.dumps(features))
PYEOF
grep -rhiE "gpu memory|reclaim|numactl|cpunodebind|membind|health" "$OUT/home/experiments/features" > "$OUT/report.txt" || true
echo "report: $OUT/report.txt ($(wc -l < "$OUT/report.txt") lines)"
