"""Command-line shells (the only click users on the capture side): capture-run and the helpers every CLI shares."""
