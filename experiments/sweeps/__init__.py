"""Sweeps: the sweep files in this folder (``*.yaml``), their expansion into runs, learning-rate tuning, run state
and where runs execute (``cluster``). ``python -m experiments.sweep`` runs ``experiments.sweeps.sweep``."""
