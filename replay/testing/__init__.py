"""The pytest plugin and the parity fixture (the only pytest users); loads without torch."""
