"""Where and how trials run: the Ray cluster (`cluster`), what a trial reserves (`placement`),
what runs it (`programs`: our trainer or MaxText), its processes (`processes` on this host,
`slices` one per host of a TPU slice), the Tune trainable that watches them (`trainable`),
and Tune's saved state as resume needs it (`tune_state`)."""
