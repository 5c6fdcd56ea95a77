"""The decoder-only transformer a trial trains, its kernels, MoE routing, fp8 and loss."""

from absl import flags

# tokamax reads its absl flags on first use, parsing sys.argv if nobody has: our own command
# lines (the trainer's, a benchmark's) are not absl's, so its defaults are taken as parsed.
# Here, before any module of the package imports tokamax (splash, grouped_matmul, fp8_gmm).
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
