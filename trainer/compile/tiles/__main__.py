"""`python -m trainer.compile.tiles --config trial.json --vmem 16384,32768`: the trial's
kernels tuned under each scoped VMEM limit, one JSON line per limit (what `sweeper tiles`
prints as a table): which tiles each limit admits, and the best of them as priced."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.compile.tiles", description=__doc__)
    parser.add_argument("--config", required=True, help="trial configuration JSON file")
    parser.add_argument("--vmem", required=True, help="scoped VMEM limits in KiB, comma-separated")
    args = parser.parse_args(argv)

    from trainer.cli import prepare_environment
    from trainer.trial.config import ConfigError, load_config

    try:
        config = load_config(json.loads(Path(args.config).read_text()))
        limits = [int(v) for v in args.vmem.split(",") if v.strip()]
        if config.compile_target is None:
            raise ConfigError("compile_target", "the tuner compiles for a TPU target: set one")
    except (ConfigError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    prepare_environment(config)  # JAX on CPU, libtpu's flags: before JAX is imported
    from trainer.compile.aot import topology_devices
    from trainer.compile.tiles.search import as_json, tune
    from trainer.trial.checks import check_static, global_batch_size
    from trainer.trial.files import cache_dir
    from trainer.trial.hardware import Backend, Topology

    topology = Topology.parse(config.compile_target)
    devices = topology_devices(topology.target)
    try:
        degrees = check_static(config, len(devices), Backend.TPU)
    except ConfigError as exc:
        print(json.dumps({"error": f"{exc.field}: {exc.message}"}), flush=True)
        return 2
    batch = global_batch_size(config, len(devices))
    for limit in limits:
        tuning, untuned = tune(
            config, batch, degrees, topology, devices[0], cache_dir(config), limit
        )
        print(json.dumps({"vmem_kib": limit, **as_json(tuning, untuned)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
