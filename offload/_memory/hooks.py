"""The interception point: which saved tensors the engine takes, and what one it leaves becomes.

Owns the eligibility rules (``Eligibility``) and the pass-through (``pack_passed`` /
``unpack_passed``); the session's hook pair (``Session.hooks``, handed to
``torch.autograd.graph.saved_tensors_hooks``) asks the one and uses the other. A tensor the
engine does not take passes through: pack keeps a detached alias of it (same storage, no
grad_fn) and unpack checks its version and returns it, which is what autograd does without hooks.

Passed through, and why:
- parameters, leaves that require grad, views of those (``weight.t()``), and storages of
  registered modules' parameters and buffers: something else keeps them alive, so moving them
  frees nothing;
- storages under ``min_offload_bytes``: fixed costs beat the savings;
- tensors on another device than the engine's; meta, sparse, quantized, nested, conj/neg-bit and
  functorch-wrapped tensors; tensor subclasses (FakeTensor and FunctionalTensor while tracing,
  DTensor): the engine handles plain dense storages only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from .._errors import inplace_error

__all__ = [
    "Eligibility",
    "HookPair",
    "never_traced",
    "no_offload",
    "pack_passed",
    "unhooked",
    "unpack_passed",
    "users_own",
]

HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
"""A (pack, unpack) pair, as ``torch.autograd.graph.saved_tensors_hooks`` takes it."""

unhooked: contextvars.ContextVar[Optional[HookPair]] = contextvars.ContextVar("offload_unhooked", default=None)
"""The hook pair of an engine this thread is inside while the pair is off the hook stack (None: no
such engine): ``offload.sharded`` pushes it for its block. See Note: [no hooks where nothing moves]
in ``offload._memory.session``."""

try:  # torch 2.6+: a per-code flag Dynamo's frame evaluator reads (See Note: [Dynamo never traces the hooks])
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
except ImportError:
    _set_code_exec_strategy = None  # type: ignore[assignment]  # torch before 2.6: the disable wrapper

_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
_Tensor = torch.Tensor
_STRIDED = torch.strided


def users_own(t: torch.Tensor) -> bool:
    """Whether ``t`` is the user's, so neither moving nor dropping a save of it frees anything: a
    parameter or other subclass (fake, functional, DTensor), a leaf that requires grad (an input),
    or a view of one. A view is judged by its base alone: views made under no_grad (inside a
    custom Function's forward) of an activation require grad and count as leaves, yet free
    memory when moved. The engine's hooks and the recompute tier both apply this rule."""
    if type(t) is not _Tensor:
        return True
    base = t._base
    if base is None:
        return t.requires_grad and t.is_leaf
    return type(base) is not _Tensor or (base.requires_grad and base.is_leaf)


class Eligibility:
    """Decides, per saved tensor, whether the engine manages it."""

    def __init__(self, device: Optional[torch.device], min_bytes: int) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.skip_storages: set[int] = set()
        self.small_saves = 0
        """Tensors on a candidate device passed through for being under ``min_bytes`` (the
        engine warns when a step saved nothing else)."""

    def skip_modules(self, modules: Iterable[torch.nn.Module]) -> None:
        """Never move the storages of these modules' parameters and buffers.

        The set is rebuilt, not added to: a storage freed since the last step (``to()``,
        ``load_state_dict``) leaves an address the allocator may hand to an activation, which a
        stale entry would then wrongly pass through.
        """
        self.skip_storages = {t.untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())}

    def __call__(self, t: torch.Tensor) -> bool:
        return self.take(t) is not None

    def take(self, t: torch.Tensor) -> Optional[torch.UntypedStorage]:
        """``t``'s storage if the engine manages ``t``, else None (it passes through). The hook
        hands the storage on, so the store does not ask ``t`` for it again.

        A plain dense tensor whose storage is large enough and not a module's is taken. Layout and
        functorch wrapping are asked first (a sparse or wrapped tensor has no storage to ask
        for), then the size, so a small tensor, the common pass-through, is done after one
        storage read; what else would exclude it is not asked."""
        if users_own(t):
            return None
        device = t.device
        adopt = None
        if device != self.device:  # the first tensor (no device yet), device="cuda", or another device
            adopt = self._adoptable(device)
            if adopt is None:
                return None
        if t.layout is not _STRIDED or _is_functorch_wrapped(t):
            return None
        storage = t.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            self.small_saves += 1
            return None
        if t.is_quantized or t.is_nested or t.is_conj() or t.is_neg() or storage._cdata in self.skip_storages:
            return None
        if adopt is not None:
            self.device = adopt
        return storage

    def _adoptable(self, device: torch.device) -> Optional[torch.device]:
        """For a tensor on another device than the engine's: the engine's device if the tensor is
        taken, or None where it never is. Without a device yet, the first eligible CPU or CUDA
        tensor's becomes it (not a small or odd one's: a model's first save may be a CPU index
        tensor), so ``take`` sets it only once the tensor passed. ``device="cuda"`` names the
        current CUDA device: pinned to its index now that CUDA is in use, whatever the tensor is.
        Meta and other devices are never taken."""
        if self.device is None:
            if device.type == "cpu" or (device.type == "cuda" and device.index is not None):
                return device
            return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None
        if self.device.index is None and device.type == self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            return self.device if device == self.device else None
        return None


# Note: [pass through a detached alias]
#     A tensor the engine leaves alone must not be handed back to autograd as itself. A node that
#     saves its own output (tanh, sigmoid, softmax, attention) would then hold that output, whose
#     grad_fn is the node: a cycle through autograd's C++ graph, which Python's collector cannot
#     see, so a forward without backward leaked its whole graph. ``t.detach()`` shares storage and
#     version counter but has no grad_fn (torch's saved_tensors_hooks docs ask for exactly this).
#     And since saved-tensor hooks switch off autograd's in-place check, unpack checks the version
#     itself and raises the error PyTorch would. The pair is a plain tuple (alias, version at
#     pack): the engine's own handles are never tuples, so unpack tells the two apart by type,
#     and a tuple costs no Python-level constructor on the path most small saves take.


def pack_passed(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What pack keeps of a tensor passed through. See Note: [pass through a detached alias]."""
    return (t.detach(), t._version)


def unpack_passed(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The tensor ``pack_passed`` kept, once its version says it was not modified in place."""
    alias, version = packed
    if alias._version != version:
        raise inplace_error(alias.type(), alias.shape, alias._version, version)
    return alias


# Note: [Dynamo never traces the hooks]
#     Autograd calls pack and unpack from C++, as new Python frames. Where those frames start while
#     a compiled function runs its Python code eagerly (the frame Dynamo gave up on: a graph break
#     in a loop, such as a region in ``for block in self.blocks`` of a compiled model), Dynamo
#     compiles them as frames of their own: it traced pack's eligibility test into a graph and
#     failed there (``'NoneType' object has no attribute 'is_leaf'`` from ``users_own``), and a
#     pack it did compile would have run the store's side effects as a graph. So the hooks' code
#     is marked for Dynamo to skip, with everything it calls: a flag on the code object that the
#     frame evaluator reads (torch 2.6+), free on a call, unlike ``torch.compiler.disable``, whose
#     wrapper costs ~0.9 us a call (older torch gets that wrapper).


def never_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, never compiled by Dynamo, nor anything it calls. See Note: [Dynamo never traces the hooks]."""
    if _set_code_exec_strategy is None:
        return torch.compiler.disable(fn)
    _set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return fn


def no_offload() -> torch.autograd.graph.saved_tensors_hooks:
    """A context in which saved tensors stay where they are (e.g. around an LM head).

    It installs pass-through saved-tensor hooks; only the innermost hooks are active, so an
    engine around it does not see what is saved inside. See Note: [pass through a detached alias].
    """
    return torch.autograd.graph.saved_tensors_hooks(pack_passed, unpack_passed)
