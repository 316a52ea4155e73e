"""Training-run comparison: two recorded runs step by step, and reruns of a recorded training."""
