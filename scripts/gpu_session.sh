#!/usr/bin/env bash
# One device call: prepare real text (the Python standard library's sources), then benchmark training under a
# 24 GiB cap. Wheels for packages missing on the GPU image travel in .whl/.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" | tee -a "$OUT/gpu.txt"
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
DATA=outputs/data/pystdlib
time python3 -m scripts.prepare_data --files "$STDLIB/**/*.py" --output_dir $DATA --vocab_size 65536 \
  --seq_len 2048 --eval_samples 16 --num_proc 16 --max_documents 6000 2>&1 | grep -v "it/s\]" | tail -5
python3 -m scripts.bench_train --data_dir $DATA --presets "$@" --cap_gib 24 --steps 30 --warmup 5 \
  --peak_flops 780e12 --output_dir "$OUT/bench" --extra --config_overrides depth_distribution=fixed 2>&1 | grep -vE "it/s\]|s/it\]" | tail -40
cp "$OUT/bench/results.json" "$OUT/bench_results.json" 2>/dev/null
for p in "$@"; do cp "$OUT/bench/$p/log_history.json" "$OUT/log_$p.json" 2>/dev/null; done
