#!/usr/bin/env bash
# What the lent v5e machine offers the engine, read once (docs/facts.md, v5e): its Python,
# devices, device files and sockets; the install; one trial's phases; a two-trial sweep of
# the engine as a user types it (no Ray there: the host executor). Writes under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
echo "== machine"; python3 --version; nproc; ls -d /dev/accel* /dev/vfio/* 2>&1 | head
python3 -c 'import platform; print(platform.libc_ver())'
echo "== install"; bash benchmarks/v5e/setup.sh; source benchmarks/v5e/env.sh
python3 - <<'PY'
import importlib, json
for name in ("jax", "jaxlib", "libtpu", "flax", "optax", "qwix", "tokamax", "tune_jax", "ray", "optuna", "mlflow", "pandas", "pydantic", "typer", "rich"):
    try:
        m = importlib.import_module(name); print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "FAILED", type(exc).__name__, str(exc)[:200])
import jax
d = jax.devices()[0]
print("devices", jax.devices(), d.device_kind, json.dumps({k: v for k, v in (d.memory_stats() or {}).items() if "limit" in k}))
from sweeper.execute.host import tcp_refused
print("tcp:", tcp_refused())
PY
echo "== matmul peaks ($(( $(date +%s) - t0 )) s in)"
python3 -m benchmarks.accelerator_mfu --child peak
echo "== one trial ($(( $(date +%s) - t0 )) s in)"
cat > /tmp/pilot_trial.json <<'JSON'
{"model": {"preset": "v5e-dense-270m"}, "seq_len": 1024, "per_device_batch": 8, "steps": 8,
 "backend": "tpu", "kernels": {"attention": "splash"}, "convergence": {"enabled": false}}
JSON
s=$(date +%s); python3 -m trainer --config /tmp/pilot_trial.json > "$OUT/pilot_trial.jsonl" 2> "$OUT/pilot_trial.err"; echo "exit $? in $(( $(date +%s) - s )) s"
python3 - "$OUT/pilot_trial.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    keep = ("time", "event", "compile_s", "step_time_s", "tokens_per_sec_per_chip", "mfu", "hbm_per_device_gib", "failure_class", "message", "hardware", "device_kind")
    print({k: (str(v)[:300] if isinstance(v, str) else v) for k, v in e.items() if k in keep})
PY
tail -5 "$OUT/pilot_trial.err"
echo "== a sweep as typed ($(( $(date +%s) - t0 )) s in)"
s=$(date +%s)
timeout -s INT 240 python3 -m sweeper run v5e_dense --trials 2 --set search.remeasure=0 \
  --set trial.seq_len=1024 --set trial.steps=8 --results-dir "$OUT/results" 2>&1 | tail -30
echo "sweep: $(( $(date +%s) - s )) s"
tar -czf "$OUT/pilot_results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
echo "== total $(( $(date +%s) - t0 )) s"
