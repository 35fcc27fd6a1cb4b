"""Names of this project's Serve objects, torch-free: the control plane (``eagle_platform.rollout``) computes
them without importing the serving code."""

from __future__ import annotations

import re


def deployment_name(model: str) -> str:
    """The Serve deployment of a pair: ``pair-<model>`` with anything outside [A-Za-z0-9_.-] replaced (it is
    also the name of the pair's application in the one-application-per-pair layout)."""
    return "pair-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model)
