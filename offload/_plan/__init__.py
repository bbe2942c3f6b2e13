"""Numbers in, plans out: profiles, fits, the policies and the plan cache.

Nothing here touches a tensor of the user's or a device: the profiler turns measured numbers
into profiles, ``fit`` and ``pace`` turn them into costs, ``planner`` simulates a step and
``policy`` chooses per region. It imports only the vocabulary at the top (``_cost``, ``_budget``).
"""
