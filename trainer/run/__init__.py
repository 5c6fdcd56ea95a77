"""Run fidelity: training the program on attached devices, timed and judged."""
