"""The embedded local Slurm cluster: one slurmctld and one ``slurmd -N`` per node on 127.0.0.1."""
