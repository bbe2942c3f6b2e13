"""Where saved tensors live and how they move: hooks, the session, the store and its tiers.

The hooks hand each saved tensor to the session; the store keeps it hot on the device, sends it
to pinned host memory (``tiers``, ``transfer``, ``arena``) and on to disk (``spill``), and brings
it back for backward. ``residency`` is the one owner of where an entry is; ``probe`` measures the
link all of this moves over. Nothing here re-runs user code or plans: it moves what it is told.
"""
