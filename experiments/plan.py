"""``python -m experiments.plan``: the planner's command, kept at its documented name (experiments.planner.plan)."""

from experiments.planner.plan import main

if __name__ == "__main__":
    main()
