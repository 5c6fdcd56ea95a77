#!/usr/bin/env bash
# Measurements on the lent TPU v5e, in stages that fit its 10-minute calls; each stage goes
# on from what the one before left in results/ (ignored by git, kept while the machine stays
# warm, carried back otherwise). Results come back under $OUT as archives.
#   bash benchmarks/v5e/measure.sh grid  SECONDS  # v5e_dense's every point (space_grid)
#   bash benchmarks/v5e/measure.sh sweep SECONDS  # `sweeper run v5e_dense` as a user types it
#   bash benchmarks/v5e/measure.sh session SECONDS # a session's calls, each the same command
#       (wheels: .whl-mt too):
#       kernels.tune three ways and MaxText beside our trainer once each (MaxText's install
#       runs beside the first), then the committed sweep (results/v5e) resumed where the chip
#       first wrote it (results/, its paths as recorded) until done; each call packs all of it
#       into $OUT/v5e_session.tgz
#   bash benchmarks/v5e/measure.sh moe SECONDS    # v5e_moe's every point (space_grid, resumed
#       from results/v5e_moe_grid), then kernels.tune on its trial 0 (Megablox) once; packs
#       both into $OUT/v5e_moe.tgz. Its predictions are committed before this runs.
#   SPACE=NAME bash benchmarks/v5e/measure.sh space SECONDS  # any v5e space's every point
#       (space_grid, resumed from results/NAME_grid), packed into $OUT/NAME.tgz. Its
#       predictions are committed before this runs.
set -u
STAGE=$1
SECONDS_LEFT=$2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results
t0=$(date +%s)
MACHINE_PYTHONPATH=${PYTHONPATH:-}
ls /opt/pypi/simple > "$OUT/index.txt" 2>/dev/null
bash benchmarks/v5e/setup.sh
source benchmarks/v5e/env.sh
# Compiled programs kept across trials (JAX's key holds LIBTPU_INIT_ARGS, so a program
# compiled under other flags is never reused: jax/_src/cache_key.py, _hash_xla_flags).
export SWEEPER_JAX_CACHE_DIR=$PWD/results/jax_cache
left() { echo $(( SECONDS_LEFT - ($(date +%s) - t0) )); }
python3 -c "import mlflow, optuna, ray.tune; from sweeper.sweep.lifecycle import Sweep; print('engine imports')" 2>&1 | tail -3
maxtext_install() {  # MaxText 0.2.5 under /tmp/mtsite and a Python that finds it
  MTSITE=/tmp/mtsite
  if [ ! -f "$MTSITE/.installed" ]; then  # MaxText 0.2.5's needs: the index's, then carried
    mt_pip() {
      PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-cache-dir \
        --no-compile --disable-pip-version-check --target "$MTSITE" --only-binary=:all: \
        --index-url file:///opt/pypi/simple "$@" > /dev/null 2>&1
    }
    wanted="transformers sympy pillow tensorstore orbax-checkpoint ml-collections jinja2 regex
      huggingface-hub tokenizers safetensors sentencepiece"
    # (transformers from the index wants huggingface-hub < 2: the index's, not the carried 2.4)
    mt_pip $wanted || for name in $wanted; do mt_pip "$name" || echo "not installed: $name"; done
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-cache-dir --no-compile \
      --disable-pip-version-check --upgrade --target "$MTSITE" --no-index --no-deps \
      --ignore-requires-python $(ls .whl-mt/*.whl | grep -v huggingface_hub) \
      > /tmp/pip_mt.log 2>&1 || tail -5 /tmp/pip_mt.log
    touch "$MTSITE/.installed"
  fi
  cat > /tmp/maxtext_python <<PY
#!/bin/sh
export PYTHONPATH=$PWD/benchmarks/v5e/maxtext_shim:$MACHINE_PYTHONPATH:$MTSITE:$SITE
exec python3 "\$@"
PY
  chmod +x /tmp/maxtext_python
  export MAXTEXT_PYTHON=/tmp/maxtext_python
}
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
  session)
    (maxtext_install > /tmp/mt_install.log 2>&1) &
    installing=$!
    if [ ! -f results/v5e_tune/.tried ]; then  # each tried once, whatever came of it
      echo "== kernels.tune ($(( $(date +%s) - t0 )) s in)"
      timeout 330 python3 -m benchmarks.v5e.tune_trials run results/v5e_tune
      touch results/v5e_tune/.tried
    fi
    wait $installing; cat /tmp/mt_install.log
    export MAXTEXT_PYTHON=/tmp/maxtext_python
    if [ ! -f results/v5e_maxtext/.tried ] && [ "$(left)" -gt 300 ]; then
      echo "== MaxText beside our trainer ($(( $(date +%s) - t0 )) s in)"
      timeout $(( $(left) - 60 )) python3 -m benchmarks.v5e.maxtext_side_by_side results/v5e_maxtext
      touch results/v5e_maxtext/.tried
    fi
    [ -d results/v5e_dense ] || cp -r results/v5e/. results/
    id=$(ls results/v5e_dense | tail -1)
    if ! grep -q '"state": "finished"' "results/v5e_dense/$id/sweep.json" && [ "$(left)" -gt 120 ]; then
      echo "== sweeper resume $id ($(( $(date +%s) - t0 )) s in)"
      timeout -s INT $(( $(left) - 45 )) python3 -m sweeper resume "$id" --results-dir results 2>&1 | tail -40
    fi
    tar -czf "$OUT/v5e_session.tgz" results/v5e_dense results/optuna.db results/mlflow.db \
      results/mlartifacts results/ray results/v5e_tune results/v5e_maxtext 2>/dev/null
    ls -la "$OUT"
    ;;
  moe)
    if [ ! -f results/v5e_moe_grid/grid.csv ] && [ -f benchmarks/data/v5e_moe_grid.csv ]; then
      mkdir -p results/v5e_moe_grid  # the points committed so far: the grid resumes from them
      grep -v '^#' benchmarks/data/v5e_moe_grid.csv > results/v5e_moe_grid/grid.csv
    fi
    python3 -m benchmarks.space_grid v5e_moe --out results/v5e_moe_grid --cache results/cache \
      --resume --budget $(( $(left) - 60 )) 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -40
    if [ ! -f results/v5e_moe_tune/.tried ] && [ "$(left)" -gt 300 ]; then
      echo "== kernels.tune, v5e_moe ($(( $(date +%s) - t0 )) s in)"
      timeout $(( $(left) - 30 )) python3 -m benchmarks.v5e.tune_trials run results/v5e_moe_tune v5e_moe
      touch results/v5e_moe_tune/.tried
    fi
    tar -czf "$OUT/v5e_moe.tgz" results/v5e_moe_grid/grid.csv results/v5e_moe_grid/*.log \
      results/v5e_moe_tune 2>/dev/null
    ls -la "$OUT"
    ;;
  space)
    python3 -m benchmarks.space_grid "$SPACE" --out "results/${SPACE}_grid" --cache results/cache \
      --resume --budget $(( $(left) - 60 )) 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -40
    tar -czf "$OUT/$SPACE.tgz" "results/${SPACE}_grid/grid.csv" results/"${SPACE}"_grid/*.log
    ls -la "$OUT"
    ;;
esac
echo "stage $STAGE: $(( $(date +%s) - t0 )) s"
