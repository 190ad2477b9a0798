"""``python -m asyncsgd`` runs the CLI."""

from .cli import main

main()
