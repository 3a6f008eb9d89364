"""The step supervisor of an in-allocation job (``omni supervise``): see ``run.py``."""
