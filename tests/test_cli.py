"""The CLI on a tiny checkpoint: streams text, prints the summary, reports bad input clearly."""

from __future__ import annotations

import pytest
import torch

from quickdraft.cli import build_parser, main


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for option in ("--model", "--dtype", "--max-tokens", "--temperature", "--top-p", "--seed", "--stop"):
        assert option in text


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_generate_streams_and_summarises(tiny_checkpoints, capsys):
    code = main(
        ["generate", "hello", "--model", str(tiny_checkpoints["llama"]), "--max-tokens", "5", "--max-model-len", "64"]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.startswith("hello")
    assert "5 tokens (length)" in captured.err and "TTFT" in captured.err and "tokens/s" in captured.err


def test_generate_engine_options_reach_the_engine(tiny_checkpoints, capsys, monkeypatch):
    from quickdraft import llm as llm_module

    made = []
    real = llm_module.LLM

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(llm_module, "LLM", recording)
    argv = [
        "generate",
        "hello",
        "--model",
        str(tiny_checkpoints["llama"]),
        "--max-tokens",
        "3",
        "--max-model-len",
        "64",
    ]
    assert main([*argv, "--kv-cache-dtype", "float16"]) == 0
    assert made[0].engine.cache.keys[0].dtype == torch.float16
    with pytest.raises(SystemExit):
        main([*argv, "--kv-cache-dtype", "bfloat8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert main([*argv, "--lazy-logits-rows", "3"]) == 0
    assert made[-1].config.lazy_logits_rows == 3
    assert main([*argv, "--lazy-logits-rows", "auto"]) == 0
    assert made[-1].config.lazy_logits_rows is None
    with pytest.raises(SystemExit):
        main([*argv, "--lazy-logits-rows", "-2"])
    assert "expected 'auto' or an integer >= 0, got '-2'" in capsys.readouterr().err


def test_generate_with_tensor_parallel_prints_what_one_process_prints(tiny_checkpoints, capsys):
    command = ["generate", "hello", "--model", str(tiny_checkpoints["llama"]), "--max-tokens", "8"]
    command += ["--max-model-len", "64", "--dtype", "float32"]
    assert main(command) == 0
    single = capsys.readouterr().out
    assert main([*command, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single
    assert main([*command, "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size must be a positive integer, got 0" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_parser_defaults_are_greedy():
    args = build_parser().parse_args(["generate", "p"])
    assert args.temperature == 0.0 and args.max_tokens == 128 and args.model is None


def test_speculative_generate_prints_acceptance_and_speedup(tiny_checkpoints, capsys):
    code = main(
        [
            "generate",
            "abcabcabcabc",
            "--model",
            str(tiny_checkpoints["gemma3"]),
            "--max-tokens",
            "24",
            "--max-model-len",
            "128",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}',
            "--compare-plain",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "speculation:" in err and "acceptance length" in err and "accepted by position" in err
    assert "speedup" in err and "identical" in err


def test_bad_speculative_config_json(tiny_checkpoints, capsys):
    assert main(["generate", "x", "--model", str(tiny_checkpoints["llama"]), "--speculative-config", "{nope"]) == 2
    assert "--speculative-config is not valid JSON" in capsys.readouterr().err


def test_train_head_options_reach_the_config_and_errors_are_clear(tmp_path, capsys, monkeypatch):
    import quickdraft.train.heads as heads

    seen = {}

    def fake_train(config, *, progress):
        seen["config"] = config
        raise ValueError("stop here")

    monkeypatch.setattr(heads, "train_head", fake_train)
    code = main(
        [
            "train-head",
            "--method",
            "self",
            "--out",
            str(tmp_path / "o"),
            "--exit-layer",
            "7",
            "--num-prompts",
            "40",
            "--prompt-mix",
            "docs",
            "--draft-vocab-size",
            "4096",
            "--no-progress",
        ]
    )
    assert code == 2 and "stop here" in capsys.readouterr().err
    config = seen["config"]
    assert (config.method, config.exit_layer, config.num_prompts, config.prompt_mix, config.draft_vocab_size) == (
        "self",
        7,
        40,
        "docs",
        4096,
    )
    assert config.command.startswith("quickdraft train-head --method self")
    assert main(["train-head", "--out", str(tmp_path / "o"), "--extra-data", str(tmp_path)]) == 2
    assert "holds no shard" in capsys.readouterr().err
    assert main(["train-head", "--out", str(tmp_path / "o"), "--val-data", str(tmp_path)]) == 2
    assert "val_data folder" in capsys.readouterr().err
    from tests.drafters.test_eagle import random_head

    random_head(tmp_path / "trained")
    code = main(
        [
            "train-head",
            "--out",
            str(tmp_path / "o"),
            "--init-head",
            str(tmp_path / "trained"),
            "--copy-dim",
            "32",
            "--no-progress",
        ]
    )
    assert code == 2 and "stop here" in capsys.readouterr().err
    assert seen["config"].copy_dim == 32 and seen["config"].init_head == tmp_path / "trained"


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "quickdraft", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: quickdraft" in done.stdout


def test_generate_runs_a_lora_adapter_and_compares_with_plain_under_it(tiny_checkpoints, capsys, tmp_path):
    """--lora (llama-cli's flag): the streamed text is LLM.generate's under the adapter, and
    --compare-plain decodes plainly under the same adapter (outputs identical)."""
    from quickdraft import LLM, LoRARequest, SamplingParams
    from tests.models.test_lora import write_peft_adapter

    base = tiny_checkpoints["gemma3"]
    adapter = write_peft_adapter(base, tmp_path / "adapter", seed=5)
    args = ["generate", "hello", "--model", str(base), "--max-tokens", "12", "--max-model-len", "64"]
    args += ["--lora", str(adapter), "--speculative-config", '{"method": "ngram"}', "--compare-plain"]
    assert main(args) == 0
    captured = capsys.readouterr()
    llm = LLM(str(base), enable_lora=True, max_model_len=64)
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = llm.generate(["hello"], params, lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].text
    assert captured.out.strip() == ("hello" + expected).strip()
    assert expected != llm.generate(["hello"], params)[0].outputs[0].text
    assert "outputs identical" in captured.err
    assert main(["generate", "hi", "--model", str(base), "--lora", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err
