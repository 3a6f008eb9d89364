"""The migratable training runtime (torch).

``omni train --config job.toml`` runs one rank: :mod:`layout` reads its place from the environment
(RANK, WORLD_SIZE, OMNI_*), :mod:`loop` trains it (pipeline stages from :mod:`model` and
:mod:`pipeline`, data from :mod:`data`, checkpoints through :mod:`checkpointing`), :mod:`heartbeat`
and :mod:`metrics` report it, and :mod:`exitcodes` says how it ended. :mod:`launch` starts the ranks
of a job on one machine (tests, benchmarks, the demo).
"""
