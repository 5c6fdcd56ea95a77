"""MaxText as a trial program: its settings run in its own Python, its output read back as our events."""
