"""The engine registry: every name a spec may use has exactly one implementation, built by name."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from rlkube.api import parse_rljob
from rlkube.api.contract import ENGINES
from rlkube.runtime.rollout import ENGINE_REGISTRY, engine_options, make_engine
from rlkube.runtime.rollout.registry import OPTIONS_FUNCTION


def test_registry_and_api_engine_names_agree() -> None:
    assert sorted(ENGINE_REGISTRY) == sorted(ENGINES)


@pytest.mark.parametrize("name", sorted(ENGINE_REGISTRY))
def test_every_registered_engine_names_a_real_class(name: str) -> None:
    entry = ENGINE_REGISTRY[name]
    module = importlib.import_module(entry.module)
    assert isinstance(getattr(module, entry.cls), type)
    options = getattr(module, OPTIONS_FUNCTION, None)
    assert options is None or callable(options)


def test_options_come_from_the_spec_per_engine() -> None:
    job = {
        "spec": {
            "model": {"path": "/m"},
            "data": {"train": "/t", "reward": "arith", "maxPromptLength": 16, "maxResponseLength": 48},
            "algorithm": {"groupSize": 4},
            "training": {"trainBatchSize": 2, "seed": 7},
            "rollout": {"engine": "vllm", "maxNumSeqs": 6, "tensorParallelSize": 2},
            "gpu": {"vendor": "cpu"},
            "trainer": {"gpusPerReplica": 0},
        }
    }
    spec = parse_rljob(job).spec
    vllm = engine_options(spec)
    assert (vllm["max_model_len"], vllm["seed"], vllm["tensor_parallel_size"]) == (64, 7, 2)
    hf = engine_options(spec, "hf")
    assert (hf["num_slots"], hf["max_seq_len"]) == (6, 64)  # 2 prompts x 4 samples, capped at maxNumSeqs 6
    assert engine_options(spec, "sglang") == {}


def test_an_unknown_engine_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hf"):
        make_engine("trtllm")
    with pytest.raises(ValueError, match="model_path"):
        make_engine("vllm")
