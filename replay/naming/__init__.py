"""Pairing the port's names with the bundle's: --map files, wrapper names and --map auto."""
