"""``python -m experiments.plan``: the planner's command, kept at its documented name (experiments.planner.cli)."""

from experiments.planner.cli import main

if __name__ == "__main__":
    main()
