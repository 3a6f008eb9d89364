"""The Slurm boundary: the one place that runs Slurm commands and parses what they print."""
