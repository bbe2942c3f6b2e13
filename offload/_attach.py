"""What the engine puts on a user's module, and what a copy of that module leaves out.

The engine reaches into a module in one way: it sets instance attributes. Regions get a wrapper
in ``forward`` (or in ``_compiled_call_impl`` for a block compiled in place), the decorator form
puts one in ``forward`` and the engine in ``offload_engine``, and the Hugging Face callback wraps
``forward`` for the length of ``train()``. Each of these closes over *this* module's forward and
*this* engine.

Note: [a copy carries no engine]
    ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` all copy a module through
    ``__reduce_ex__``, which reads the module's state with ``__getstate__``. Copied as they are, the
    attributes above would make the copy call the original's forward: an EMA model, a DPO reference
    model or an evaluation copy would compute with the original's weights and train them, and
    pickling would fail on the closures. So wherever the engine sets an attribute it also sets
    ``__getstate__`` on the instance (an attribute lookup finds the instance's before the class's):
    the class's own state, with each attached attribute put back to what the module held before
    the engine came (or left out where it held none). A copy is then the module as it was without
    the engine: its own parameters, no ``offload_engine``, and no hooks into an engine it does not
    know. Wrap the copy to run it under an engine of its own. A wrapper another library set on top
    of the engine's (it calls the engine's, so the original module) is left out of the copy too,
    with a warning naming it. ``torch.nn.Module.__getstate__``
    already drops ``_compiled_call_impl`` from copies; that stays dropped.

    attach(m, "forward", wrapper) ──▶ m.__dict__: forward=wrapper, __getstate__=_CopyGuard
    deepcopy(m)                    ──▶ state = type(m).__getstate__(m), forward as before attach
    detach(m, "forward", previous) ──▶ forward put back; the guard goes with the last attribute

``attach`` returns what the instance held before; ``detach`` takes it back. Another wrapper set
on top of the engine's in the meantime (a library that wraps ``forward`` again) is the caller's to
leave alone, as the Hugging Face callback does.

Note: [engines detached out of order]
    Two engines may wrap one module in turn (the second's wrapper calls the first's). Closed in the
    order they came, the first's ``detach`` would put back what the module held before it, and so
    strip the second's wrapper too: the second engine would silently run none of its regions, and
    its own ``detach`` would then leave the first's wrapper on the module, unguarded, for copies to
    carry. So each ``attach`` is a layer; a layer detached from under another leaves the module
    alone (its wrapper stays in the chain, and passes calls through once its engine is closed) and
    hands what it would have put back to the layer above, whose ``detach`` puts that back.

    attach A, attach B    ──▶ forward = B(A(f)); layers [A: back to f], [B: back to A]
    detach A (under B)    ──▶ forward unchanged; layers [B: back to f]
    detach B              ──▶ forward = f (here: none), the guard goes
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch

__all__ = ["attach", "attached", "detach"]

_GETSTATE = "__getstate__"


class _Absent:
    """The module held no instance attribute of that name before the engine set one."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


@dataclasses.dataclass
class _Layer:
    """One ``attach`` of an attribute, still in force: See Note: [engines detached out of order]."""

    token: Any
    """What the instance held when it came: ``attach``'s return value, which its ``detach`` names."""
    restore: Any
    """What its ``detach`` puts back: the token, or what a layer detached from under it would have."""


class _CopyGuard:
    """A module's ``__getstate__`` while the engine has attributes on it: See Note: [a copy carries no engine]."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)  # the module holds the guard; no cycle back
        self.before: dict[str, Any] = {}
        """Attribute name -> what the module's ``__dict__`` held before the engine's first attach."""
        self.set: dict[str, Any] = {}
        """Attribute name -> what the engine set there last."""
        self.layers: dict[str, list[_Layer]] = {}
        """Attribute name -> its attaches still in force, oldest first."""

    def __call__(self) -> dict:
        module = self._module()
        if module is None:  # only reachable through the module, so it is alive; kept for type checkers
            return {}
        state = type(module).__getstate__(module)
        state = dict(state) if state is module.__dict__ else state
        state.pop(_GETSTATE, None)
        for name, before in self.before.items():
            if name not in state:
                continue  # the class leaves it out of copies itself (_compiled_call_impl)
            if state[name] is not self.set.get(name):
                # Wrapped again since (accelerate's autocast, another library): that wrapper calls the
                # engine's, which calls the original module; the copy must not. It loses that wrapper.
                warnings.warn(
                    f"offload: copying a {type(module).__name__} whose {name!r} was wrapped again after the engine "
                    f"wrapped it ({state[name]!r:.60}); the copy gets the {name!r} it had before the engine, "
                    "without that later wrapper (which calls the original module, not the copy): wrap the copy "
                    "again as the original was",
                    UserWarning,
                    stacklevel=3,
                )
            if before is _ABSENT:
                del state[name]
            else:
                state[name] = before
        return state


def attach(module: torch.nn.Module, name: str, value: Any) -> Any:
    """Set ``module.<name> = value`` as an instance attribute that copies of the module leave out.
    Returns what the instance held before (a token for ``detach``: "nothing" is one too)."""
    previous = module.__dict__.get(name, _ABSENT)
    guard = module.__dict__.get(_GETSTATE)
    if not isinstance(guard, _CopyGuard):
        guard = _CopyGuard(module)
        object.__setattr__(module, _GETSTATE, guard)
    guard.before.setdefault(name, previous)
    guard.set[name] = value
    guard.layers.setdefault(name, []).append(_Layer(previous, previous))
    object.__setattr__(module, name, value)  # not nn.Module's: an engine or a function is no submodule
    return previous


def detach(module: torch.nn.Module, name: str, previous: Any) -> None:
    """Put back ``previous``, what ``attach`` returned. Once the module holds what it held before
    the engine came, copies need no guard. An attach with another still in force above it leaves
    the module as it is (See Note: [engines detached out of order])."""
    guard = module.__dict__.get(_GETSTATE)
    layers = guard.layers.get(name, []) if isinstance(guard, _CopyGuard) else []
    at = next((i for i in reversed(range(len(layers))) if layers[i].token is previous), None)
    if at is not None:
        layer = layers.pop(at)
        if at < len(layers):  # a later attach wraps this one's value and is still in force
            layers[at].restore = layer.restore
            return
        previous = layer.restore
    if previous is _ABSENT:
        module.__dict__.pop(name, None)
    else:
        object.__setattr__(module, name, previous)
    guard = module.__dict__.get(_GETSTATE)
    if not isinstance(guard, _CopyGuard):
        return
    before = guard.before.get(name, _ABSENT)
    if module.__dict__.get(name, _ABSENT) is before:
        guard.before.pop(name, None)
        guard.set.pop(name, None)
        guard.layers.pop(name, None)
    else:
        guard.set[name] = module.__dict__.get(name, _ABSENT)
    if not guard.before:
        del module.__dict__[_GETSTATE]


def attached(module: torch.nn.Module, name: str) -> bool:
    """Whether the engine has set ``module.<name>`` (and not put it back yet)."""
    guard = module.__dict__.get(_GETSTATE)
    return isinstance(guard, _CopyGuard) and name in guard.before
