#!/usr/bin/env bash
# The lent TPU v5e machine (shared/docs/V5E.md; docs/facts.md, v5e): Python 3.11 with JAX
# 0.10.2 and libtpu 0.0.42.1 on PYTHONPATH, no network. What the engine needs beyond them
# comes from the machine's own package index and from wheels carried in .whl-tpu (the list:
# benchmarks/v5e/wheels.txt, fetched on a networked host by benchmarks/v5e/fetch_wheels.sh).
# Installs under $SITE (default /tmp/site), then: source benchmarks/v5e/env.sh
set -u
SITE=${SITE:-/tmp/site}
INDEX=file:///opt/pypi/simple
pip_install() {
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-cache-dir --no-compile \
    --disable-pip-version-check --upgrade --target "$SITE" "$@"
}
if [ ! -f "$SITE/.installed" ]; then
  start=$(date +%s)
  # From the machine's index, with their needs, a group at a time (pip gives up a whole
  # install for one need the index lacks; then each of the group alone).
  have=$(ls /opt/pypi/simple)
  for group in "flax optax optuna ray pandas pyarrow rich typer filelock pyyaml matplotlib psutil
      jaxtyping absl-py tqdm annotated-doc colorlog" \
      "sqlalchemy alembic cachetools click cloudpickle fastapi gitpython importlib-metadata
      python-dotenv requests sqlparse starlette uvicorn flask flask-cors protobuf"; do
    found=""
    for name in $group; do
      if echo "$have" | grep -qx "$name"; then found="$found $name"; else echo "not in the index: $name"; fi
    done
    pip_install --only-binary=:all: --index-url "$INDEX" $found > /tmp/pip_group.log 2>&1 || {
      for name in $found; do
        pip_install --only-binary=:all: --index-url "$INDEX" "$name" > /dev/null 2>&1 ||
          echo "could not install from the index: $name"
      done
    }
  done
  # Last: an index package installed after them would replace a namespace folder they share
  # (opentelemetry/), dropping their part of it.
  pip_install --no-index --no-deps .whl-tpu/*.whl > /tmp/pip_wheels.log 2>&1 ||
    { echo "the carried wheels did not install:"; tail -5 /tmp/pip_wheels.log; }
  touch "$SITE/.installed"
  echo "installed in $(( $(date +%s) - start )) s"
fi
