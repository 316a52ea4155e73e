"""Every byte on disk: bundle, training file and multi-rank manifest, each behind a version gate and validators."""
