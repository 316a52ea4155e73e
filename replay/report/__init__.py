"""Rendering (the only tabulate and matplotlib users): pure functions of result objects."""
