#!/bin/sh
# small experiment of the latent-recurrence seed paper (MATH.md, "LRT") at the tiny tier (d = 64, F = 432 solved for untied K = 4, T = 128,
# batch 8, stdlib characters), training FLOPs matched to untied K = 8 at 120 updates (flops.py).
# Run from the repository root with OMP_NUM_THREADS=1; a failed run stops the script, printing its log's end.
set -e
COMMON="--size tiny --width 432 --dataset stdlib --tokenizer char --seed 1 --sample_tokens 0 --quiet"
run() { name=$1; shift; iters=$1; shift
  /usr/bin/time -f "$name wall %e s cpu %U s" python train.py "$@" $COMMON --max_iters $iters --eval_interval $iters \
      --out_dir runs/lrt-exp/$name > runs/lrt-exp/$name.log 2>&1 || { tail -3 runs/lrt-exp/$name.log >&2; exit 1; }
  tail -1 runs/lrt-exp/$name.log; }
mkdir -p runs/lrt-exp
run untied-4 233 --model untied --depth 4
run untied-8 120 --model untied --depth 8
run lrt-4 119 --model lrt --depth 4
run lrt-think-4 53 --model lrt-think --depth 4
run lrt-8 61 --model lrt --depth 8
run ponder-4 27 --model ponder --depth 4 --n_thoughts 1
run loopstack-2x4 120 --model loopstack --depth 2 --n_core 4
