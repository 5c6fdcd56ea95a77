"""The analytic step model and the planner: formulas and a datasheet, no JAX (fidelity estimate)."""
