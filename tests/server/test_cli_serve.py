"""`quickdraft serve`: options reach the server config; bad options are clear errors."""

from __future__ import annotations

import pytest

import quickdraft.server
from quickdraft.cli import main
from quickdraft.server import ServerConfig


def test_serve_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for option in ("MODEL", "--speculative-config", "--host", "--port", "--max-model-len", "--max-num-seqs",
                   "--dtype", "--device", "--max-queue", "--served-model-name"):
        assert option in text, option


def test_serve_options_reach_the_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    code = main(["serve", str(tmp_path), "--speculative-config", '{"method": "suffix"}', "--host", "0.0.0.0",
                 "--port", "9001", "--max-model-len", "256", "--max-num-seqs", "3", "--dtype", "bfloat16",
                 "--max-queue", "5", "--served-model-name", "mine"])
    assert code == 0
    config = seen[0]
    assert config.model == str(tmp_path) and config.speculative_config == {"method": "suffix"}
    assert (config.host, config.port, config.max_model_len, config.max_num_seqs) == ("0.0.0.0", 9001, 256, 3)
    assert (config.dtype, config.max_queue, config.model_name) == ("bfloat16", 5, "mine")


def test_serve_defaults_to_the_embedded_model(monkeypatch):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    assert main(["serve"]) == 0
    assert seen[0].model is None and seen[0].model_name == "gemma-3-270m"
    assert (seen[0].host, seen[0].port) == ("127.0.0.1", 8000)


def test_serve_bad_options_are_clear_errors(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--speculative-config", "{nope"]) == 2
    assert "--speculative-config is not valid JSON" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-queue", "0"]) == 2
    assert "max_queue" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_server_config_validates():
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="shutdown_grace_seconds"):
        ServerConfig(shutdown_grace_seconds=-1)
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig(served_model_name=" ")
    assert ServerConfig(model="/models/foo.gguf").model_name == "foo"
