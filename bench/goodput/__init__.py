"""Goodput at scale: a simulator of a long run on a large cluster under three recovery policies.

``failures`` draws the interruptions (Llama 3 405B categories, Poisson arrivals), ``inputs`` holds
the defaults and reads the measured files, ``models`` scales them to per-event costs on the large
run, ``sim`` plays one policy over one trace, ``run`` is the command line (``python -m
bench.goodput``).
"""
