"""Reading runs: ``compare`` (and the launcher of the CLI subprocesses it runs),
tables and report.md, plots."""
