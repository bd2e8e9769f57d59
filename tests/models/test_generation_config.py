"""Default sampling from a model's generation_config.json (vLLM's --generation-config)."""

from __future__ import annotations

import json

import pytest

from quickdraft.models.generation_config import default_sampling_fields


def model_dir(tmp_path, config: dict | str | None):
    (tmp_path / "config.json").write_text("{}")
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_recommended_sampling_of_an_hf_directory(tmp_path):
    config = {
        "do_sample": True,
        "top_k": 64,
        "top_p": 0.95,
        "max_new_tokens": 100,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }
    directory = model_dir(tmp_path, config)
    assert default_sampling_fields(str(directory)) == {"top_k": 64, "top_p": 0.95, "max_tokens": 100}
    assert default_sampling_fields(str(directory), source="vllm") == {}
    overridden = default_sampling_fields(str(directory), overrides={"top_k": 10, "temperature": 0.5})
    assert overridden == {"top_k": 10, "top_p": 0.95, "max_tokens": 100, "temperature": 0.5}


def test_models_without_a_generation_config_keep_the_library_defaults(tmp_path):
    assert default_sampling_fields(None) == {}  # the embedded GGUF
    assert default_sampling_fields(str(tmp_path / "model.gguf")) == {}
    assert default_sampling_fields(str(model_dir(tmp_path, None))) == {}
    assert default_sampling_fields(None, overrides={"temperature": 0}) == {"temperature": 0}


def test_a_directory_given_as_the_source(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    elsewhere = model_dir(tmp_path / "elsewhere", {"temperature": 0.3})
    assert default_sampling_fields(None, source=str(elsewhere)) == {"temperature": 0.3}


@pytest.mark.parametrize(
    ("config", "source", "overrides", "message"),
    [
        ({"top_p": 1.5}, "auto", None, "top_p must be <= 1"),
        ("{not json", "auto", None, "cannot read"),
        ("[1, 2]", "auto", None, "does not hold a JSON object"),
        ({}, "/no/such/dir", None, "is not a directory"),
        ({}, "", None, "must be 'auto', 'vllm' or a directory"),
        ({}, "auto", {"temprature": 0.5}, "unknown keys ['temprature']"),
        ({}, "auto", {"top_k": "many"}, "top_k must be an int"),
    ],
)
def test_bad_settings_name_themselves(tmp_path, config, source, overrides, message):
    directory = model_dir(tmp_path, config)
    with pytest.raises(ValueError) as caught:
        default_sampling_fields(str(directory), source=source, overrides=overrides)
    assert message in str(caught.value)
