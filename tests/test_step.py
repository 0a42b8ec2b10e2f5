"""hf_memwatch.estimation.step: the step replay leaves the fake model as it found it, and its phases."""

from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import GPT2Config

from hf_memwatch.core.run_config import model_is_checkpointing
from hf_memwatch.estimation.fake_model import fake_model
from hf_memwatch.estimation.request import EstimateRequest
from hf_memwatch.estimation.step import FORWARD_BACKWARD_PHASES, StepInputs, simulate_step

CFG = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)


def _setup(**changes):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, config, task = fake_model(CFG, None, fake_mode)
    request = EstimateRequest(micro_batch_size=2, seq_len=16, task=task, **changes).resolved(None)
    return model, fake_mode, request, StepInputs(config=config)


def test_a_replay_restores_forward_kv_cache_and_checkpointing_so_a_second_replay_is_the_same():
    model, fake_mode, request, inputs = _setup(precision="bf16", activation_checkpointing=True)
    use_cache = model.config.use_cache
    first = simulate_step(model, fake_mode, request, inputs)
    assert "forward" not in model.__dict__  # accelerate's autocast wrapper removed
    assert model.config.use_cache == use_cache
    assert not model_is_checkpointing(model)  # switched on for the replay only
    second = simulate_step(model, fake_mode, request, inputs)
    assert second.phase_classes == first.phase_classes
    assert set(first.phase_classes) == {"after_optimizer", "after_forward", "after_backward", "step_end"}


def test_without_the_optimizer_step_only_forward_and_backward_and_no_state():
    model, fake_mode, request, inputs = _setup()
    full = simulate_step(model, fake_mode, request, inputs)
    floor = simulate_step(model, fake_mode, request.replace(optimizer_step=False), inputs)
    assert set(floor.phase_classes) == set(FORWARD_BACKWARD_PHASES)
    assert all(classes["optimizer_states"] == 0 for classes in floor.phase_classes.values())
    state = full.phase_classes["after_backward"]["optimizer_states"]
    assert state > 0
    # the floor lies under the full step's backward by exactly the resident optimizer state
    assert sum(floor.phase_classes["after_backward"].values()) + state == sum(
        full.phase_classes["after_backward"].values())
