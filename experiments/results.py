"""Where every experiment writes its figures: ``experiments/results/NAME.md`` and ``.json``."""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_results(name: str, table_md: str, rows: list) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(table_md + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
