"""``python -m experiments.plan_capacity``: the capacity table's command, kept at its documented name
(experiments.planner.capacity)."""

from experiments.planner.capacity import main

if __name__ == "__main__":
    main()
