"""Adam as ``torch.optim.Adam`` computes it, without importing TorchDynamo.

``torch.optim.Optimizer`` wraps ``add_param_group`` (so its constructor), ``zero_grad``,
``state_dict`` and ``load_state_dict`` in ``torch._disable_dynamo``, whose first call imports
TorchDynamo, and ``Adam.step`` in ``_use_grad_for_differentiable``, which imports it at every call.
The import cost a run 3.2-3.7 s of its set-up on an H100 machine (2026-11-25, 1d988d6;
docs/PERFORMANCE.md, "Evaluation and checkpoints in a run") where nothing is compiled: a short run
(``--compile auto`` keeps those eager) never needs TorchDynamo otherwise.

:class:`Adam` calls the same functions without those wrappers. Their only job is to keep
TorchDynamo from tracing into the optimizer when a compiled region calls it, and streamnmt never
calls the optimizer inside a compiled region (it compiles the model and its loss, see
``training.step.make_step``). The state dict, the fused and capturable kernels and the numbers are
``torch.optim.Adam``'s own (a test compares them). Where a torch build wraps them differently (no
``__wrapped__``), the wrapped method is kept: the import then happens, nothing else changes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)  # Adam.step less _use_grad_for_differentiable


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` whose construction, step, ``zero_grad`` and state dicts do not import
    TorchDynamo (see the module docstring)."""

    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad)
    state_dict = inspect.unwrap(torch.optim.Optimizer.state_dict)
    load_state_dict = inspect.unwrap(torch.optim.Optimizer.load_state_dict)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        # what _use_grad_for_differentiable does around it, less its TorchDynamo graph break
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return _ADAM_STEP(self, closure)
