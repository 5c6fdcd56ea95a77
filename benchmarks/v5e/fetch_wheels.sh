#!/usr/bin/env bash
# On a networked host: the wheels benchmarks/v5e/wheels.txt lists, into .whl-tpu (git-ignored;
# the device tool carries it). Python 3.11, manylinux x86-64, no dependencies.
set -eu
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl-tpu $(grep -v '^#' benchmarks/v5e/wheels.txt)
