# Source after benchmarks/v5e/setup.sh: the machine's own JAX first, then what setup.sh
# installed, then this checkout (the engine and trainer run from the source tree).
SITE=${SITE:-/tmp/site}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD"
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
