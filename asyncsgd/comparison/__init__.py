"""``asyncsgd compare``'s runner: mode specs, one run of a mode, progress, linked hosts,
and the CLI subprocesses it launches."""
