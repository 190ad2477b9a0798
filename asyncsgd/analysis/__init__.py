"""Reading runs: tables and report.md, results.json, plots, the parameter server's
staleness."""
