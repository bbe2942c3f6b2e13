"""Predict before renting the GPU: one step on the meta device, priced for a named machine.

``fake_step`` runs the model on meta tensors and ``count`` records what it saves and computes;
``table`` prices every policy on those counts for a machine of ``machines`` (or this CPU,
``this_cpu``); ``prediction`` is the record ``offload.predict`` returns.
"""
