"""The settings machinery without a process: knob variants, composition, parsed values."""

import dataclasses
import json
import pickle

import pytest

from asyncsgd.config import (CompareConfig, Compression, Consistency, DDPConfig, HogwildConfig,
                             JobConfig, RayJobConfig, ServerConfig, SingleConfig, TrainConfig,
                             WorkerConfig, config_from_dict, make_config)
from asyncsgd.config.knobs import knob, settings
from asyncsgd.errors import ConfigError


def _field(cls, name):
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_a_command_reads_its_variant_and_falls_back_along_its_sources():
    one = knob("x", int, 1, "base", per_command={"a": "for a", "b": dict(default=2, show="two")})
    A = settings("A", "a", "A.", one, module=__name__)
    B = settings("B", "b", "B.", one, module=__name__)
    C = settings("C", "c", "C.", A, module=__name__)  # C has no variant: it reads A's
    assert (_field(A, "x").default, _field(A, "x").metadata["help"]) == (1, "for a")
    assert (_field(B, "x").default, _field(B, "x").metadata["help"],
            _field(B, "x").metadata["show"]) == (2, "base", "two")
    assert _field(C, "x").metadata["help"] == "for a"


def test_a_variant_may_set_only_what_a_command_can_change():
    with pytest.raises(TypeError, match="variant may set only"):
        knob("x", int, 1, "base", per_command={"a": dict(type=str)})


def test_shared_settings_keep_each_commands_default_and_the_old_class_tree():
    assert (CompareConfig().eval_every, HogwildConfig().eval_every) == (1.0, 2.0)
    assert (ServerConfig().momentum, SingleConfig().momentum) == (0.9, 0.0)
    assert (JobConfig().bind, RayJobConfig().bind, RayJobConfig().workers) == (None, None, 2)
    assert isinstance(DDPConfig(), SingleConfig) and isinstance(HogwildConfig(), TrainConfig)
    assert "workers" not in {f.name for f in dataclasses.fields(JobConfig)}


def test_consistency_is_parsed_once_and_written_as_its_text():
    cfg = make_config(ServerConfig, None, {"consistency": "ssp:2"})
    assert (cfg.consistency.kind, cfg.consistency.bound) == ("ssp", 2)
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["consistency"] == "ssp:2"
    back = config_from_dict(ServerConfig, saved)
    assert isinstance(back.consistency, Consistency) and back.consistency.bound == 2
    assert pickle.loads(pickle.dumps(back)).consistency.kind == "ssp"
    with pytest.raises(ConfigError, match="use async, ssp:K"):
        ServerConfig(consistency="ssp:-1")


def test_compress_is_a_value_with_kind_and_ratio():
    cfg = make_config(WorkerConfig, None, {"compress": "topk:0.01"})
    assert (cfg.compress.kind, cfg.compress.ratio, cfg.compress) == ("topk", 0.01, "topk:0.01")
    assert isinstance(WorkerConfig().compress, Compression) and WorkerConfig().compress == "none"
    with pytest.raises(AttributeError):
        cfg.compress.kind = "int8"
