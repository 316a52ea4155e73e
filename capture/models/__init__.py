"""How to get a model: adapters, safe checkpoint loading, built-in hf/nemo adapters (both sides and ckpt-diff)."""
