#!/usr/bin/env bash
# `make bench-gpu`: the GPU benchmarks, run on a GPU machine (here: through the device tool, one
# H200 with torch but no rlkube install, no Ray, no vLLM, no network).
#   bash bench/gpu/run.sh [weights] [rollout] [trainer] [ipc] [decode-step] [linear-layers] [linear-rollout]
#   [harvest-ab] [split-down-ab] [gated-ab] [grouped-ab] [overlap] [fold-ab] [attention-variants]
#   [kernels-ab] (default: the first three)
# harvest-ab: the rollout with each chunk's tokens copied to the host behind it (the default) and
# without (all read at collection), one after the other (harvest-ab/ under $out).
# split-down-ab: the down projection split-K (hf_decode.split_k_partials): the residual GEMMs alone
# per split at 512 rows, the 512-row step per split (partials summed in the next norm, or "-sep" by
# their own kernel), then the rollout without it and with it (2 and 4 slices) for buckets of >= 256
# rows (split-down-ab/ under $out).
# split-down-b64-ab: the b64 rollout with the down projection as cuBLAS runs it (its own split-K and
# reduce kernel at 64 rows) and split by hf_decode.split_k_partials (the partials summed in the next
# norm, so the reduce kernel and its gap go) for buckets of >= 64 rows, two pairs of processes
# off, on, off, on (split-down-b64-ab/off1 ... on2 under $out; each process time-boxed to 130 s,
# so the four fit one 600 s device call).
# gated-ab: gate/up + SiLU as one Triton GEMM with the SiLU in its epilogue (hf_decode's
# gated_min_rows): the layer alone at 256 and 512 rows per launch against cuBLAS + the SiLU kernel
# and against the bare GEMM, the 512-row step with it off and on, then the b512 rollout off and on
# for buckets of >= 256 rows (gated-ab/ under $out; time-boxed to one 600 s device call).
# grouped-ab: the grouped attention kernel (hf_decode's grouped_attention_min_rows): the kernel alone
# against the per-row one (Triton's launch defaults and 8 warps) at the b512 and b64 shapes, then
# the b512 rollout off and on for buckets of >= 512 rows (grouped-ab/ under $out; time-boxed to one
# 600 s device call).
# overlap: the decode step's layers over two row halves on two CUDA streams, and with the MLP norm
# folded into the gate/up weight, against all rows on one stream (overlap_gpu.py; 1.5b and 0.5b
# at 512 rows, OVERLAP_ARGS to change).
# fold-ab: the b512 and b64 rollout with the decode step's MLP norm unfolded, then folded
# (hf_decode's fold_mlp_norm; fold-ab/off1 and fold-ab/on1 under $out, one pair to fit a 600 s
# call; AB_PAIRS=2 for two; stop 41's results, in bench/results/h100-stop41/fold-ab/, are in off/ and on/).
# attention-variants: the decode attention kernel's code variants against the engine's, the access
# pattern's own bound, the SiLU per launch and the step's GEMMs split-K (attention_variants_gpu.py;
# ATTENTION_VARIANTS_ARGS to change, e.g. "--old-kernels <checkout>/runtime/rollout/kernels.py").
# kernels-ab: the rollout with this tree's kernels.py and with OLD_KERNELS (another version of
# runtime/rollout/kernels.py, e.g. `git show <rev>:runtime/rollout/kernels.py > .ab/kernels.py`,
# carried to the GPU machine), or with OLD_OVERLAY (a folder of older files at their repo paths,
# e.g. .ab/tree/runtime/rollout/hf_decode.py), in alternating processes new, old, new, old
# (kernels-ab/new1 ... under $out; KERNELS_AB_RUNS to change the order, KERNELS_AB_SIZES and
# KERNELS_AB_SHAPES, default 1.5b,0.5b and rl; each process time-boxed to KERNELS_AB_SECONDS, 130).
# linear-layers / linear-rollout: the fused linear kernel (rollout/decode_linear.py; off, slower on
# an H100 at stop 29), in two calls of a few minutes each (linear-ab/ under $out): each layer alone against
# cuBLAS per launch setting (64 and 512 rows) and the decode step with it on and off; then the
# rollout at the engine's default and with the kernel on for buckets of <= 64 rows.
# Extra arguments per bench: WEIGHTS_ARGS, ROLLOUT_ARGS, TRAINER_ARGS, IPC_ARGS, DECODE_STEP_ARGS
# (e.g. ROLLOUT_ARGS="--sizes 0.5b").
# Results: $OUT/<name>.json when OUT is set (the device tool), else bench/results/, and gpu-bounds.png.
set -uo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
# Keep NVLink multicast off (shared GPUs; see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-$top/bench/results}
mkdir -p "$out"

# No rlkube install is needed: each benchmark maps rlkube onto this checkout itself, lazily (the GPU
# machine has no pydantic, so rlkube.api must never be imported there).
export PYTHONPATH=${PYTHONPATH:-}
# Wheels carried to the machine (e.g. trl for the trainer comparison) go into a private target.
if ls "$top"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/whl-site "$top"/.whl/*.whl \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/whl-site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

status=0
# One rollout_gpu.py process: rollout_in DIR SECONDS TREE ARGS... runs TREE's rollout_gpu.py
# --skip-generate ARGS into $out/DIR, time-boxed to SECONDS. The JSON has it all, so the log's tail
# goes to stdout rather than to a file (the device tool brings back at most 8 files).
rollout_in() {
  local dir=$out/$1 limit=$2 tree=$3
  shift 3
  mkdir -p "$dir"
  OUT=$dir timeout "$limit" python3 "$tree/bench/gpu/rollout_gpu.py" --skip-generate "$@" | tail -4 || status=1
}

# The rollout at both sizes with one setting off and on in alternating processes:
# rollout_ab DIR SECONDS SHAPES FLAG OFF ON PAIRS runs rollout_gpu.py on SHAPES with "FLAG OFF" into
# $out/DIR/off1 and "FLAG ON" into $out/DIR/on1, then off2, on2 ... up to PAIRS (AB_PAIRS overrides
# it), each process time-boxed to SECONDS. Alternating pairs show the spread between processes
# (1-2% at b64), which one pair cannot tell from the setting's effect.
rollout_ab() {
  local dir=$1 limit=$2 shapes=$3 flag=$4 off=$5 on=$6 pairs=${AB_PAIRS:-$7} i
  for ((i = 1; i <= pairs; i++)); do
    rollout_in "$dir/off$i" "$limit" "$top" --sizes 1.5b,0.5b --shapes "$shapes" "$flag" "$off"
    rollout_in "$dir/on$i" "$limit" "$top" --sizes 1.5b,0.5b --shapes "$shapes" "$flag" "$on"
  done
}

for bench in ${*:-weights rollout trainer}; do
  echo "=== bench-gpu: $bench ($(date -u +%H:%M:%S))"
  case $bench in
    weights) python3 "$top/bench/gpu/weights_gpu.py" --out "$out/weights-gpu.json" ${WEIGHTS_ARGS:-} || status=1 ;;
    rollout) OUT=$out python3 "$top/bench/gpu/rollout_gpu.py" ${ROLLOUT_ARGS:-} > "$out/rollout-gpu.log" || status=1 ;;
    trainer) OUT=$out python3 "$top/bench/gpu/trainer_gpu.py" ${TRAINER_ARGS:-} > "$out/trainer-gpu.log" || status=1 ;;
    ipc) OUT=$out python3 "$top/bench/gpu/ipc_gpu.py" ${IPC_ARGS:-} > "$out/ipc-gpu.log" || status=1 ;;
    decode-step) OUT=$out python3 "$top/bench/gpu/decode_step_gpu.py" ${DECODE_STEP_ARGS:-} > "$out/decode-step-gpu.log" || status=1 ;;
    overlap) OUT=$out python3 "$top/bench/gpu/overlap_gpu.py" ${OVERLAP_ARGS:-} > "$out/overlap-gpu.log" || status=1 ;;
    attention-variants)
      OUT=$out python3 "$top/bench/gpu/attention_variants_gpu.py" ${ATTENTION_VARIANTS_ARGS:-} \
        > "$out/attention-variants-gpu.log" || status=1 ;;
    fold-ab) rollout_ab fold-ab 280 b512,b64 --fold-mlp-norm off on 1 ;;
    split-down-b64-ab) rollout_ab split-down-b64-ab 130 b64 --down-split-min-rows 0 64 2 ;;
    linear-layers)
      mkdir -p "$out/linear-ab"
      OUT=$out/linear-ab python3 "$top/bench/gpu/decode_step_gpu.py" --sizes 0.5b,1.5b --rows 64,512 \
        --configs cublas,linear,cublas --linear default,bn32,bn64,bn128,bk64,2x,w8,t128,t64x128 \
        --linear-rows 64,512 --repeats 5 --no-capture-check > "$out/linear-ab/decode-step-gpu.log" || status=1 ;;
    harvest-ab)
      mkdir -p "$out/harvest-ab/off"
      OUT=$out/harvest-ab python3 "$top/bench/gpu/rollout_gpu.py" --skip-generate --shapes b64,b512 \
        > "$out/harvest-ab/rollout-gpu.log" || status=1
      OUT=$out/harvest-ab/off python3 "$top/bench/gpu/rollout_gpu.py" --skip-generate --shapes b64,b512 \
        --harvest off > "$out/harvest-ab/off/rollout-gpu.log" || status=1 ;;
    split-down-ab)
      mkdir -p "$out/split-down-ab"
      # time-boxed to fit one 600 s device call (each part saves what it measured as it goes), and
      # at most 8 files (the device tool's limit): the split runs' logs go to stdout
      OUT=$out/split-down-ab timeout 240 python3 "$top/bench/gpu/decode_step_gpu.py" --sizes 1.5b,0.5b --rows 512 \
        --configs default,down-k2,down-k4,down-k2-sep,default --linear bmm2,bmm4 --linear-rows 512 \
        --repeats 3 --no-capture-check > "$out/split-down-ab/decode-step-gpu.log" || status=1
      OUT=$out/split-down-ab timeout 110 python3 "$top/bench/gpu/rollout_gpu.py" --skip-generate --sizes 1.5b,0.5b --shapes b512 \
        --down-split-min-rows 0 > "$out/split-down-ab/rollout-gpu.log" || status=1
      for k in 2 4; do
        rollout_in "split-down-ab/on-k$k" 110 "$top" --sizes 1.5b,0.5b --shapes b512 --down-split-min-rows 256 --down-split-k $k
      done ;;
    gated-ab)
      mkdir -p "$out/gated-ab"
      OUT=$out/gated-ab timeout 260 python3 "$top/bench/gpu/decode_step_gpu.py" --sizes 1.5b,0.5b --rows 512 \
        --configs default,gated,gated-t64x128,gated-t128x64,default --repeats 3 --no-capture-check \
        --linear t128,t128s4,t64x128,t128x64,t128x64w8,t64x256,gemm-only --linear-rows 512,256 \
        --linear-layers gated > "$out/gated-ab/decode-step-gpu.log" || status=1
      rollout_ab gated-ab 140 b512 --gated-min-rows 0 256 1 ;;
    grouped-ab)
      mkdir -p "$out/grouped-ab"
      OUT=$out/grouped-ab timeout 120 python3 "$top/bench/gpu/decode_step_gpu.py" --sizes= --rows 64 \
        --attention default,grouped,grouped-w8 --attention-shapes b512,b64 --repeats 5 --no-capture-check \
        > "$out/grouped-ab/decode-step-gpu.log" || status=1
      rollout_ab grouped-ab 210 b512 --grouped-attention-min-rows 0 512 1 ;;
    kernels-ab)
      if [ ! -f "${OLD_KERNELS:-}" ] && [ ! -d "${OLD_OVERLAY:-}" ]; then
        echo "kernels-ab needs OLD_KERNELS=<an old kernels.py> or OLD_OVERLAY=<a folder of old files>"; status=2; continue
      fi
      old=$(mktemp -d)  # this tree with the old files in place
      tar -C "$top" --exclude=./.git --exclude=./bench/results -cf - . | tar -C "$old" -xf -
      [ -f "${OLD_KERNELS:-}" ] && cp "$OLD_KERNELS" "$old/runtime/rollout/kernels.py"
      [ -d "${OLD_OVERLAY:-}" ] && cp -r "$OLD_OVERLAY/." "$old/"
      for run in ${KERNELS_AB_RUNS:-new1 old1 new2 old2}; do
        tree=$top; [ "${run#old}" != "$run" ] && tree=$old
        rollout_in "kernels-ab/$run" "${KERNELS_AB_SECONDS:-130}" "$tree" \
          --sizes "${KERNELS_AB_SIZES:-1.5b,0.5b}" --shapes "${KERNELS_AB_SHAPES:-rl}"
      done
      rm -rf "$old" ;;
    linear-rollout)
      mkdir -p "$out/linear-ab/on"
      OUT=$out/linear-ab python3 "$top/bench/gpu/rollout_gpu.py" --skip-generate \
        > "$out/linear-ab/rollout-gpu.log" || status=1
      OUT=$out/linear-ab/on python3 "$top/bench/gpu/rollout_gpu.py" --skip-generate --linear-max-rows 64 \
        > "$out/linear-ab/on/rollout-gpu.log" || status=1 ;;
    *) echo "unknown bench $bench"; status=2 ;;
  esac
done
# Each fraction of its bound, with the targets (needs matplotlib; the GPU image has it).
python3 "$top/bench/gpu/plot_bounds.py" "$out" || true
exit $status
