"""Re-running the user's blocks: regions, their recompute and selective forms, and their state.

``regions`` wraps the blocks a user names (or ``"auto"`` finds), measures them, asks ``_plan``
for a plan and carries it out per step: keep, offload, recompute (``recompute``) or keep part and
re-run the rest (``selective``). ``steps`` holds one record per kind of step (profiling, planned,
unplanned); ``module_state`` restores what a re-run would change in a module.
"""
