"""hf_memwatch.estimation.classify: the one classifier of the step and eval replays, on a real tracker."""

import torch

from hf_memwatch.estimation.classify import classify, refs
from hf_memwatch.estimation.eval_loop import EVAL_CLASSES
from hf_memwatch.estimation.fake_dispatch import EstimateTracker
from hf_memwatch.measure.saved_tensors import SavedTensorRegistry


def _tracked():
    tracker = EstimateTracker("cpu", SavedTensorRegistry())
    weight = torch.nn.Parameter(torch.ones(64))
    tracker.register([weight])
    with tracker:
        batch = torch.zeros(32)
        scratch = torch.zeros(16)
        grad = torch.zeros(64)
    return tracker, weight, batch, scratch, grad


def test_each_storage_once_in_the_first_class_that_holds_it_and_the_split_sums_to_the_live_bytes():
    tracker, weight, batch, scratch, grad = _tracked()
    live = tracker.live_refs()
    snapshot = (dict(live), set())
    weights, other = refs(tracker, [weight]), refs(tracker, [batch])
    gradients = {grad.untyped_storage()._cdata}
    classes = classify(snapshot, live, weights, gradients, set(), other)
    assert classes == {"weights": 256, "gradients": 256, "optimizer_states": 0, "activations": 0,
                       "temporaries": 64, "other": 128}
    assert sum(classes.values()) == tracker.allocated
    # the eval replay: its outputs, its class names in their order
    outputs = {id(ref): ref for ref in refs(tracker, [scratch]).values()}  # by the reference: keys get reused
    evaluated = classify(snapshot, {}, weights, set(), set(), other, outputs=outputs, names=EVAL_CLASSES)
    assert list(evaluated) == list(EVAL_CLASSES)
    assert evaluated == {"weights": 256, "optimizer_states": 0, "outputs": 64, "other": 128, "temporaries": 256}


def test_a_reused_address_is_not_the_class_of_the_storage_that_died():
    tracker, weight, batch, scratch, grad = _tracked()
    old_ref = refs(tracker, [batch])[batch.untyped_storage()._cdata]
    del batch
    with tracker:
        fresh = torch.zeros(32)
    live = tracker.live_refs()
    # the dead batch's ref recorded under the address the fresh storage now has (addresses get reused)
    other = {fresh.untyped_storage()._cdata: old_ref}
    classes = classify((dict(live), set()), live, refs(tracker, [weight]), set(), set(), other)
    assert classes["other"] == 0
    assert classes["temporaries"] == 128 + 64 + 256
