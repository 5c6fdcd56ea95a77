#!/usr/bin/env bash
# Measurements on the lent TPU v5e, in stages that fit its 10-minute calls; each stage goes
# on from what the one before left in results/ (ignored by git, kept while the machine stays
# warm, carried back otherwise). Results come back under $OUT as archives.
#   bash benchmarks/v5e/measure.sh grid  SECONDS  # v5e_dense's every point (space_grid)
#   bash benchmarks/v5e/measure.sh sweep SECONDS  # `sweeper run v5e_dense` as a user types it
set -u
STAGE=$1
SECONDS_LEFT=$2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results
t0=$(date +%s)
bash benchmarks/v5e/setup.sh
source benchmarks/v5e/env.sh
# Compiled programs kept across trials (JAX's key holds LIBTPU_INIT_ARGS, so a program
# compiled under other flags is never reused: jax/_src/cache_key.py, _hash_xla_flags).
export SWEEPER_JAX_CACHE_DIR=$PWD/results/jax_cache
left() { echo $(( SECONDS_LEFT - ($(date +%s) - t0) )); }
case "$STAGE" in
  grid)
    python3 -m benchmarks.space_grid v5e_dense --out results/v5e_grid --cache results/cache \
      --resume --budget $(( $(left) - 60 )) 2>&1 | grep -v "UserWarning\|warnings.warn"
    tar -czf "$OUT/v5e_grid.tgz" results/v5e_grid/grid.csv results/v5e_grid/*.log
    ;;
  sweep)
    if grep -q not_run results/v5e_grid/grid.csv 2>/dev/null; then
      python3 -m benchmarks.space_grid v5e_dense --out results/v5e_grid --cache results/cache \
        --resume --budget "${GRID_SECONDS:-240}" 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -45
      tar -czf "$OUT/v5e_grid.tgz" results/v5e_grid/grid.csv results/v5e_grid/*.log
    fi
    id=$(ls results/v5e_dense 2>/dev/null | tail -1)
    if [ -n "$id" ] && ! grep -q '"state": "finished"' "results/v5e_dense/$id/sweep.json"; then
      timeout -s INT $(( $(left) - 45 )) python3 -m sweeper resume "$id" --results-dir results 2>&1 | tail -60
    elif [ -z "$id" ]; then
      timeout -s INT $(( $(left) - 45 )) python3 -m sweeper run v5e_dense --results-dir results 2>&1 | tail -60
    fi
    tar -czf "$OUT/v5e_sweep.tgz" --exclude=results/jax_cache --exclude=results/v5e_grid \
      --exclude='*.npy' results
    ls -la "$OUT"
    ;;
esac
echo "stage $STAGE: $(( $(date +%s) - t0 )) s"
