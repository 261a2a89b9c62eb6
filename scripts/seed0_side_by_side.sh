#!/bin/bash
# The seed-0 benchmark figures of the code before a change (OLD) and of this
# checkout, side by side in one sitting, every job in parallel (a machine with
# many cores: 14 jobs, most of them 5 node processes).
# QUICK=1: a tiny smoke version (2 rounds, 5 steps) to test the script.
set -u
ROOT=$PWD; OLD=${OLD:?set OLD to a checkout of the code before the change (git worktree add /tmp/old REV)}; DATA=${DATA:-$ROOT/../shared/data/pneumoniamnist.npz}
OUT=${OUT:-$ROOT/runs/eq29}; mkdir -p $OUT
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1
R=10; S=100; FR=30; FW=10; SR=""
if [ "${QUICK:-0}" = 1 ]; then R=2; S=5; FR=3; FW=1; SR="--rounds 2 --steps-per-round 5"; fi
PY=${PY:-python3}
job() { local tree=$1 name=$2; shift 2
  ( cd $tree && PYTHONPATH=${SITE:+$SITE:}$tree timeout ${JOB_TIMEOUT:-570} $PY "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" >> $OUT/rc.txt ) &
  sleep 2; }
for v in old new; do
  T=$ROOT; [ $v = old ] && T=$OLD
  for h in random n_latest f1 cosine; do
    base="--no-baselines"; [ $h = random ] && base="--baselines"
    job $T ${v}_fed_$h -m bench.federation --nodes 5 --rounds $R --data $DATA --partition dirichlet:0.5 --test-split global --fraction 0.5 --heuristics $h --class-weighted --lr-schedule constant --steps-per-round $S --lr 5e-4 --augment none --threshold 0.8 --seed 0 $base --out $OUT/${v}_fed_$h
  done
  job $T ${v}_sgd -m bench.federation --nodes 5 --rounds $R --data $DATA --partition dirichlet:0.5 --test-split global --fraction 0.5 --protocol fedsgdp2p --heuristic random --class-weighted --lr-schedule constant --steps-per-round $S --lr 5e-4 --augment none --threshold 0.8 --seed 0 --no-baselines --out $OUT/${v}_sgd
  job $T ${v}_fedperl -m bench.fedperl --data $DATA --seeds 0 --rounds $FR --warmup $FW --out $OUT/${v}_fedperl
  job $T ${v}_secagg -m bench.secagg --data $DATA --seeds 0 $SR --out $OUT/${v}_secagg
done
wait
cat $OUT/rc.txt
for f in $OUT/*.log; do echo "== $f"; tail -n 1 $f | cut -c1-1500; done
