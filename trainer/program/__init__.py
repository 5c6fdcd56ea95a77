"""A trial's program: built for a list of devices, lowered and compiled; its HLO read back."""
