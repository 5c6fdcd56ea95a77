"""The decoder-only transformer a trial trains, its kernels, MoE routing, fp8 and loss."""
