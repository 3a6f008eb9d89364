"""slurm-omni: multimodal LLM training that survives failures on Slurm."""

__version__ = "0.1.0"
