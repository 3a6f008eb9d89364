"""Config files (site config, job file) loaded into frozen dataclasses."""
