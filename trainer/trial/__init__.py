"""What a trial is, with no JAX: the part of the trainer the engine shares."""
