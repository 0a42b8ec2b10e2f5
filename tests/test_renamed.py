"""One name per concept (hf_memwatch/core/renamed.py): the old keywords and flags still work for one
release, each with one FutureWarning naming the new one; the library's own code uses the new names."""

from __future__ import annotations

import warnings

import pytest
from transformers import GPT2Config

from hf_memwatch.cli.main import build_parser
from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.core.plan import Plan
from hf_memwatch.core.renamed import RENAMED
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.request import EstimateRequest

TINY = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64)


def _warned(caught: list[warnings.WarningMessage], old: str, new: str) -> None:
    """Exactly one FutureWarning, naming the old and the new name, pointed at this file."""
    ours = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert old in str(ours[0].message) and new in str(ours[0].message)
    assert ours[0].filename == __file__  # the caller's line, not the library's


@pytest.mark.parametrize(("old", "new", "value"), [("batch_size", "micro_batch_size", 2),
                                                   ("accum", "gradient_accumulation_steps", 2),
                                                   ("checkpointing", "activation_checkpointing", True)])
def test_estimate_old_keyword_warns_and_means_the_new_one(old, new, value):
    kwargs = dict(micro_batch_size=2, seq_len=16)
    kwargs.pop(new, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_old = estimate(TINY, **kwargs, **{old: value})
    _warned(caught, f"{old}=", f"{new}=")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the new name: silent
        by_new = estimate(TINY, **kwargs, **{new: value})
    assert by_old.peak_bytes == by_new.peak_bytes and by_old.config == by_new.config
    assert by_new.config[new] == value  # the config record names it as the keyword


def test_estimate_both_names_is_one_error():
    with pytest.raises(MemWatchConfigError, match="pass micro_batch_size= only"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        estimate(TINY, micro_batch_size=2, batch_size=2, seq_len=16)


def test_estimate_unknown_keyword_still_refused():
    with pytest.raises(MemWatchConfigError, match="batch_sise"):
        estimate(TINY, batch_sise=2, seq_len=16)


@pytest.mark.parametrize("cls", [RunConfig, EstimateRequest])
def test_run_and_request_old_field_name(cls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = cls(micro_batch_size=4, checkpointing=True)
    _warned(caught, "checkpointing=", "activation_checkpointing=")
    assert made == cls(micro_batch_size=4, activation_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert made.checkpointing is True  # the old attribute reads the new field
    _warned(caught, ".checkpointing", ".activation_checkpointing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert made.replace(checkpointing=False).activation_checkpointing is False
    _warned(caught, "checkpointing=", "activation_checkpointing=")
    with pytest.raises(MemWatchConfigError, match="pass activation_checkpointing= only"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        cls(micro_batch_size=4, checkpointing=True, activation_checkpointing=True)


def test_one_name_across_run_request_plan_and_estimate():
    """Plan, RunConfig, EstimateRequest and estimate() name the run's settings alike (the records' names)."""
    import dataclasses
    import inspect

    keywords = set(inspect.signature(estimate).parameters)
    from hf_memwatch.estimation.request import RUN_SETTINGS

    for cls in (RunConfig, EstimateRequest, Plan):
        fields = set(RUN_SETTINGS) if cls is EstimateRequest else {f.name for f in dataclasses.fields(cls)}
        assert set(RENAMED.values()) <= fields, cls
        assert not set(RENAMED) & fields, cls
    assert set(RENAMED.values()) <= keywords and not set(RENAMED) & keywords
    run = RunConfig(micro_batch_size=4, gradient_accumulation_steps=2, activation_checkpointing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the library's own calls use the new names
        assert set(RENAMED.values()) <= set(run.estimate_kwargs())
        assert Plan.of(run).configure(run) == run


@pytest.mark.parametrize(("argv", "dest", "value", "new"), [
    (["--batch-size", "3"], "micro_batch_size", 3, "--micro-batch-size"),
    (["--accum", "4"], "gradient_accumulation_steps", 4, "--gradient-accumulation-steps"),
    (["--checkpointing"], "activation_checkpointing", True, "--activation-checkpointing"),
    (["--no-checkpointing"], "activation_checkpointing", False, "--no-activation-checkpointing"),
])
def test_cli_old_flag_is_a_hidden_alias_that_warns(argv, dest, value, new):
    parser = build_parser()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parser.parse_args(["estimate", "m", *argv])
    ours = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(ours) == 1 and argv[0] in str(ours[0].message) and new in str(ours[0].message)
    assert getattr(args, dest) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        default = parser.parse_args(["estimate", "m"])
        given = parser.parse_args(["estimate", "m", new, *argv[1:]])
    assert getattr(given, dest) == value
    assert getattr(default, dest) == {"micro_batch_size": 8, "gradient_accumulation_steps": 1,
                                      "activation_checkpointing": None}[dest]
    estimate_parser = next(a for a in parser._subparsers._group_actions[0].choices.values()
                           if a.prog.endswith("estimate"))
    assert argv[0] not in estimate_parser.format_help()  # hidden
    assert new in estimate_parser.format_help()


def test_an_older_timeline_meta_with_batch_size_reads_as_micro_batch_size():
    from hf_memwatch.core.records import MetaRecord, parse_record, validate_record

    old = {"event": "meta", "model": "M", "params": 1, "trainable_params": 1, "batch_size": 6,
           "gradient_accumulation_steps": 2, "precision": "fp32", "optim": "adamw_torch", "world_size": 1}
    assert validate_record(old) == []
    meta = parse_record(old)
    assert isinstance(meta, MetaRecord) and meta.micro_batch_size == 6 and meta.extra == {}
    written = meta.to_dict()
    assert written["micro_batch_size"] == 6 and "batch_size" not in written  # written under the one name
    assert list(written)[:5] == ["event", "model", "params", "trainable_params", "micro_batch_size"]
    both = parse_record({**old, "micro_batch_size": 3})
    assert both.micro_batch_size == 3 and "batch_size" not in both.to_dict()  # the new key wins
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert MetaRecord(**{k: v for k, v in old.items() if k != "event"}) == meta
    _warned(caught, "batch_size=", "micro_batch_size=")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert meta.batch_size == 6
    _warned(caught, ".batch_size", ".micro_batch_size")


def test_the_estimate_config_reads_old_keys_with_one_warning():
    from hf_memwatch.core.renamed import RenamedKeys

    config = RenamedKeys({"micro_batch_size": 4, "gradient_accumulation_steps": 2, "activation_checkpointing": True})
    for old, new in RENAMED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert config[old] == config[new] and config.get(old) == config[new]
        assert len(caught) == 2 and all(c.category is FutureWarning for c in caught)
        assert f"config[{new!r}]" in str(caught[0].message)
    with pytest.raises(KeyError):
        config["nope"]  # noqa: B018
    assert RenamedKeys({"seq_len": 8}).get("batch_size", "absent") == "absent"  # the new key is not there either
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert config["micro_batch_size"] == 4 and list(config) == list(RENAMED.values())


def test_the_cli_json_writes_the_old_config_keys_beside_the_new():
    from hf_memwatch.cli.estimate import with_deprecated_keys

    payload = with_deprecated_keys({"peak_bytes": 1, "config": {"micro_batch_size": 4, "seq_len": 8,
                                                                "gradient_accumulation_steps": 1,
                                                                "activation_checkpointing": False}})
    assert payload["config"]["batch_size"] == payload["config"]["micro_batch_size"] == 4
    assert payload["config"]["accum"] == 1 and payload["config"]["checkpointing"] is False
    assert payload["deprecated_keys"] == ["config.batch_size", "config.accum", "config.checkpointing"]
    import json

    json.dumps(payload)


MEASURED_PLAN = {"event": "plan", "micro_batch_size": 2, "gradient_accumulation_steps": 4,
                 "activation_checkpointing": False, "optim": "sgd", "predicted_peak": 900, "budget": 1000,
                 "reason": "measured", "source": "measured"}


def test_an_older_timeline_plan_measurement_with_accumulating_reads_as_gradient_accumulation(tmp_path):
    import json

    from hf_memwatch.core.records import PlanRecord, validate_record
    from hf_memwatch.core.timeline import read_records

    old = [{"micro_batch_size": 2, "activation_checkpointing": False, "accumulating": True, "peak": 900, "before": 10},
           {"micro_batch_size": 4, "activation_checkpointing": True, "accumulating": False, "peak": None, "before": 0}]
    path = tmp_path / "timeline.jsonl"
    path.write_text(json.dumps({**MEASURED_PLAN, "measurements": old}) + "\n")
    unread = []
    [plan] = read_records(path, unread)
    assert unread == [] and validate_record({**MEASURED_PLAN, "measurements": old}) == []
    assert isinstance(plan, PlanRecord) and plan.extra == {}
    assert [list(m) for m in plan.measurements] == [
        ["micro_batch_size", "activation_checkpointing", "gradient_accumulation", "peak", "before"]] * 2  # in place
    assert [m["gradient_accumulation"] for m in plan.measurements] == [True, False]
    assert "accumulating" not in json.dumps(plan.to_dict())  # written again under the one name
    both = [{**old[0], "gradient_accumulation": False}]
    assert PlanRecord.from_dict({**MEASURED_PLAN, "measurements": both}).measurements == [  # the new key wins
        {"micro_batch_size": 2, "activation_checkpointing": False, "peak": 900, "before": 10,
         "gradient_accumulation": False}]


def test_the_measured_fallback_writes_gradient_accumulation():
    from hf_memwatch.core.records import PlanRecord
    from hf_memwatch.integration.measured import Measurement

    written = Measurement(2, True, 900, 10, gradient_accumulation=True).as_dict()
    assert written == {"micro_batch_size": 2, "activation_checkpointing": True, "gradient_accumulation": True,
                       "peak": 900, "before": 10}
    record = PlanRecord.from_dict({**MEASURED_PLAN, "measurements": [written]})
    assert record.to_dict()["measurements"] == [written]  # a current timeline reads back unchanged
