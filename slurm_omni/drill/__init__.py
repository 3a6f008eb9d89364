"""Drills: scontrol-triggered faults, measured and checked for equivalence."""
