"""Adam as ``torch.optim.Adam`` computes it, without importing TorchDynamo.

``torch.optim.Optimizer`` wraps ``add_param_group`` (so its constructor), ``zero_grad``,
``state_dict`` and ``load_state_dict`` in ``torch._disable_dynamo``, whose first call imports
TorchDynamo, and ``Adam.step`` in ``_use_grad_for_differentiable``, which imports it at every call.
The import costs a run seconds of its set-up (docs/PERFORMANCE.md, "Evaluation and checkpoints in
a run") where nothing is compiled: a short run
(``--compile auto`` keeps those eager) never needs TorchDynamo otherwise.

:class:`Adam` calls the same functions without those wrappers. Their only job is to keep
TorchDynamo from tracing into the optimizer when a compiled region calls it, and streamnmt never
calls the optimizer inside a compiled region (it compiles the model and its loss, see
``training.step.make_step``). The state dict, the fused and capturable kernels and the numbers are
``torch.optim.Adam``'s own (a test compares them). Where a torch build wraps them differently (no
``__wrapped__``, or another wrapper), the wrapped method is kept: the import then happens, nothing
else changes.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


def _peel(fn: Any, wrappers: tuple[Any, ...]) -> Any:
    """``fn`` less its outer layers made by one of ``wrappers`` (recognised by their code, so that a
    decorator torch adds one day is kept, not dropped); ``fn`` itself where none is."""
    codes = {w.__code__ for w in wrappers}
    while getattr(fn, "__code__", None) in codes and getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _made_by(*decorators: Any) -> tuple[Any, ...]:
    """A function each of ``decorators`` wraps (for the code of its wrapper); None ones skipped."""
    return tuple(d(lambda self=None: None) for d in decorators if d is not None)


# The layers to take off, as torch makes them: torch._disable_dynamo's closure, Adam.step's
# _use_grad_for_differentiable and the profiling hook Optimizer.__init__ puts around step.
_DISABLE = _made_by(getattr(torch, "_disable_dynamo", None))
_STEP = _made_by(getattr(importlib.import_module("torch.optim.optimizer"), "_use_grad_for_differentiable", None),
                 getattr(torch.optim.Optimizer, "profile_hook_step", None))
_ADD_PARAM_GROUP = _peel(torch.optim.Optimizer.add_param_group, _DISABLE)
_ZERO_GRAD = _peel(torch.optim.Optimizer.zero_grad, _DISABLE)
_STATE_DICT = _peel(torch.optim.Optimizer.state_dict, _DISABLE)
_LOAD_STATE_DICT = _peel(torch.optim.Optimizer.load_state_dict, _DISABLE)
_ADAM_STEP = _peel(torch.optim.Adam.step, _STEP)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` whose construction, step, ``zero_grad`` and state dicts do not import
    TorchDynamo (see the module docstring). Called inside a compiled region (streamnmt makes none),
    each is torch's own, wrappers and all."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return super().add_param_group(param_group)
        return _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if torch.compiler.is_compiling():
            return super().zero_grad(set_to_none)
        return _ZERO_GRAD(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return _LOAD_STATE_DICT(self, state_dict)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if torch.compiler.is_compiling():
            return super().step(closure)
        # what _use_grad_for_differentiable does around it, less its TorchDynamo graph break
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return _ADAM_STEP(self, closure)
