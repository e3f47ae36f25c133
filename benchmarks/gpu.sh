#!/usr/bin/env bash
# The three benchmarks on one NVIDIA GPU, on a machine without network (Python 3.12 with torch preinstalled).
#
#   benchmarks/gpu.sh wheels                  # HERE, once, with network: cp312 wheels into .whl/ (ignored by git)
#   benchmarks/gpu.sh [all|throughput|overhead|recovery|fast-recovery|fsdp] [OUT_DIR]   # THERE, in the checkout,
#                                                                                      .whl/ beside it
#
# recovery includes the fast-recovery variants (issue 24: process restart from the persistent / the local
# checkpoint, in-process restart from memory); fast-recovery runs those variants only (docs/fast-recovery.md);
# fsdp: memory per rank and step time for ddp / ddp + distributed optimizer / torch_fsdp2 / megatron_fsdp (its
# default optim_grads_params, and optim_grads; fp32) (needs 2 GPUs: --ranks 2; with one GPU it runs --ranks 1, where
# FSDP shards nothing, docs/trainer.md).
#
# Each part stays under 10 minutes on an H100 with the 125M shape (gpt_126m: 12 layers, hidden 768, 12 heads,
# vocab 50304, seq 2048, micro-batch 8, bf16). Outputs: <part>-cuda.md (the printed tables) and <part>-cuda.json
# in OUT_DIR (default: $OUT when set, as on a lent device machine, else benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
PINS="megatron-core==0.19.2 nvidia-resiliency-ext==0.7.0"   # scripts/newest/pins.txt, the newest stack

if [ "$part" = wheels ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_39_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl $PINS defusedxml einops  # einops: Megatron-FSDP
    ls .whl
    exit 0
fi

out=${2:-${OUT:-benchmarks/results}}
mkdir -p "$out"
ls .whl/*.whl >/dev/null || { echo "no .whl/ wheels: run 'benchmarks/gpu.sh wheels' where there is network" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# CUPTI for nvidia-resiliency-ext's straggler Detector (the CUDA 13 layout of that machine; others: set it yourself).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run() {  # name, then the benchmark's arguments (BENCH_OUT_NAME: another name for the outputs)
    local name=$1; shift
    local as=${BENCH_OUT_NAME:-$name}
    python3 "benchmarks/$name.py" --device cuda --json "$out/$as-cuda.json" "$@" 2>"$out/$as-cuda.log" \
        | tee "$out/$as-cuda.md"
}
case "$part" in
    throughput) run throughput --shape gpt_126m --rounds 10 --steps 5 --warmup 5 ;;
    overhead)   run resilience_overhead --shape gpt_126m --blocks 20 --block-steps 5 ;;
    recovery)   run recovery --shape gpt_126m --saves 3 --save-interval 5 --work-dir /tmp/recovery_runs ;;
    fast-recovery)
        BENCH_OUT_NAME=fast-recovery run recovery --shape gpt_126m --faults "" --modes "" \
            --variants persistent,local,inprocess \
            --work-dir /tmp/recovery_runs ;;
    fsdp) run fsdp_memory --ranks "$(nvidia-smi -L | wc -l | awk '{print ($1 >= 2) ? 2 : 1}')" ;;
    all)
        run throughput --shape gpt_126m --rounds 10 --steps 5 --warmup 5
        run resilience_overhead --shape gpt_126m --blocks 20 --block-steps 5
        run recovery --shape gpt_126m --saves 3 --save-interval 5 --work-dir /tmp/recovery_runs ;;
    *) echo "usage: benchmarks/gpu.sh [wheels|all|throughput|overhead|recovery|fast-recovery|fsdp] [OUT_DIR]" >&2
       exit 2 ;;
esac
