"""`python -m opentinker.cli` runs the command line."""

from opentinker.cli.main import main

main()
