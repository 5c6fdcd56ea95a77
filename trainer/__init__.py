"""The JAX/Flax trainer a sweep trial runs; usable on its own as `python -m trainer`."""

# Modules that import no JAX: the engine (sweeper/) may import these and only these.
JAX_FREE_MODULES = (
    "trainer.capacity",
    "trainer.config",
    "trainer.effects",
    "trainer.estimate",
    "trainer.events",
    "trainer.files",
    "trainer.flags",
    "trainer.flops",
    "trainer.hlo",
    "trainer.hardware",
    "trainer.plan",
    "trainer.policies",
    "trainer.presets",
)
