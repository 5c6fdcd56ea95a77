"""How devices split a trial's work: meshes, logical-axis rules, context load balancing, hosts."""
