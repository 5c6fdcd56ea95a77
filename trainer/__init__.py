"""The JAX/Flax trainer a sweep trial runs; usable on its own as `python -m trainer`."""
