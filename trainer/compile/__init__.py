"""Compile fidelity: the program AOT-compiled for a TPU topology, and what it will cost."""
