"""`python -m autotuner.cli ...`: the same as the `autotuner` console script."""

from autotuner.cli import main

main()
