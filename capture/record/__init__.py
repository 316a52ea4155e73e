"""Recording one run: the capture phases, noise floor, self-check, provenance and training recording."""
