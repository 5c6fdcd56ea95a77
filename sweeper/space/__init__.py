"""What a sweep searches: the space's YAML schema (`schema`), read defensively (`file`) and
loaded with overrides (`load`), checked against trial configurations and the target
(`checks`), its points (`points`), values pinned per backend (`inert`), and its fidelity
made concrete (`fidelity`)."""
