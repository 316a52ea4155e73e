"""The chained replay: rerun the port on the recorded inputs and compare every record while it runs."""
