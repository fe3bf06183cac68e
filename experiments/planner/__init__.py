"""The memory-budget planner: measured byte costs, time and gradient-energy models, an integer program, its report
and the capacity table (docs/planner.md). ``python -m experiments.plan`` runs ``experiments.planner.plan``."""
