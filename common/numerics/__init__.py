"""Framework-neutral numerics on NumPy float64: the closeness rule, tolerances, metrics and statistics."""
