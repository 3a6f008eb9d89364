"""The built-in multimodal trainer (torch), a user of the public API :mod:`slurm_omni.elastic`.

``omni train --config job.toml`` runs one rank: ``elastic.init`` gives its layout, process groups,
heartbeat, stop protocol and checkpointer, :mod:`loop` trains it with the model of :mod:`model`, the
schedule of :mod:`pipeline` and the data of :mod:`data`. :mod:`launch` starts the ranks of a job on
one machine (tests, benchmarks, the demo); :mod:`synth` writes synthetic shards.
"""
