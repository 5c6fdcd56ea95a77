"""A space's fidelity made concrete: `auto` resolved once the cluster is read, and a run's
objective the measured twin of the estimate a compile would optimise."""

from __future__ import annotations

from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space

# A run-fidelity trial measures what an estimate only predicts: the measured twin of each.
MEASURED_TWIN = {
    "est_tokens_per_sec_per_chip": "tokens_per_sec_per_chip",
    "est_mfu": "mfu",
    "est_step_time_s": "step_time_median_s",
}


def with_fidelity(space: Space, fidelity: str) -> Space:
    """`auto` made concrete; a run keeps the objective but optimises its measured twin."""
    data = space.model_dump(mode="json")
    data["fidelity"] = fidelity
    if fidelity == "run":
        for objective in filter(None, data["objective"].values()):
            metric = objective["metric"]
            if metric.startswith("est_"):
                if metric not in MEASURED_TWIN:
                    raise SpaceError(
                        f"{metric} is an estimate and the trials will run on the cluster's hardware; "
                        f"use one of {', '.join(sorted(MEASURED_TWIN.values()))} or fidelity "
                        "compile",
                        field="objective",
                    )
                objective["metric"] = MEASURED_TWIN[metric]
    return Space.model_validate(data)
