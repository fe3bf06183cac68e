"""``python -m experiments.sweep``: the sweep command, kept at its documented name (experiments.sweeps.sweep)."""

import sys

from experiments.sweeps.sweep import main

if __name__ == "__main__":
    sys.exit(main())
