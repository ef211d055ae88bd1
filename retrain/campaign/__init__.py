"""Campaigns: conditions x seeds as ordinary runs (expand.py), executed sequentially, by
local subprocess workers or as Ray tasks (run.py), with a file-based throttle shared by
Tinker workers (throttle.py)."""

from retrain.campaign.expand import RunSpec, expand_campaign
from retrain.throttle import Throttle, throttle_for

__all__ = ["RunSpec", "Throttle", "expand_campaign", "run_campaign", "throttle_for"]


def run_campaign(*args, **kwargs):
    """See retrain.campaign.run.run_campaign (imported on use)."""
    from retrain.campaign.run import run_campaign as _run

    return _run(*args, **kwargs)
