"""Command-line shells (the only click users on the replay side): parse, one library call, render, exit code."""
