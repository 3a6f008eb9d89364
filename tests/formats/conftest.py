"""Hypothesis settings for the property tests: a few hundred examples by default (the suite stays
fast on 2 cores); ``OMNI_HYPOTHESIS=thorough`` runs 20 times more."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=150, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=3000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("OMNI_HYPOTHESIS", "default"))
