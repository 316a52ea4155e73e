"""Checkpoint diff: two checkpoints compared tensor by tensor, with insights."""
