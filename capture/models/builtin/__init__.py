"""Adapters that ship with parity-harness: ``--adapter hf`` and ``--adapter nemo``."""
