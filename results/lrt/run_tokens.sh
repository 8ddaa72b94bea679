#!/bin/sh
# The same models at equal training tokens (120 updates of 8 x 128 characters each, the tiny tier's
# budget), as a second view beside the FLOP-matched run.sh (untied-8 and loopstack-2x4 there already
# have 120 updates). Run from the repository root with OMP_NUM_THREADS=1.
set -e
COMMON="--size tiny --width 432 --dataset stdlib --tokenizer char --seed 1 --sample_tokens 0 --quiet"
run() { name=$1; shift
  /usr/bin/time -f "$name wall %e s cpu %U s" python train.py "$@" $COMMON --max_iters 120 --eval_interval 120 \
      --out_dir runs/lrt-exp/$name > runs/lrt-exp/$name.log 2>&1 || { tail -3 runs/lrt-exp/$name.log >&2; exit 1; }
  tail -1 runs/lrt-exp/$name.log; }
mkdir -p runs/lrt-exp
run untied-4-t120 --model untied --depth 4
run lrt-8-t120 --model lrt --depth 8
run lrt-think-4-t120 --model lrt-think --depth 4
run ponder-4-t120 --model ponder --depth 4 --n_thoughts 1
