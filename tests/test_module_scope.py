"""hf_memwatch.measure.module_scope: the running module stamped on the census, in forward and backward."""

from __future__ import annotations

import torch

from hf_memwatch.measure.module_scope import ModuleScope
from hf_memwatch.measure.peak_tensors import NO_SCOPE, PeakCensus


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_forward_then_backward_scopes_follow_the_modules_and_leave_the_gradients_as_they_were() -> None:
    census, model = PeakCensus(), _model()
    seen: list[tuple[str, str]] = []
    model[2].register_forward_pre_hook(lambda module, args: seen.append(census.scope))  # after our pre-hook
    scope = ModuleScope(census)
    scope.attach(model)
    scope.start()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    scope.stop()
    assert seen == [("2", "forward")]
    assert census.scope == ("0", "backward")  # the backward ends in the first module, its output's gradient last
    hooked = [p.grad.clone() for p in model.parameters()]
    plain = _model()
    plain(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(hooked, plain.parameters(), strict=True))


def test_modules_outside_the_model_and_stopped_hooks_stamp_nothing() -> None:
    census, model = PeakCensus(), _model()
    scope = ModuleScope(census)
    scope.attach(model)
    scope.start()
    torch.nn.Linear(4, 4)(torch.randn(1, 4))  # not the model's
    assert census.scope == NO_SCOPE
    scope.stop()
    model(torch.randn(1, 4))
    assert census.scope == NO_SCOPE
    scope.set_stage("optimizer")
    assert census.scope == ("(optimizer)", "optimizer")
