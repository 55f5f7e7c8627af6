"""`python -m runners.cli`: the same as the `vigil` console script."""

from runners.cli import main

main()
