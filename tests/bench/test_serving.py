"""`quickdraft bench serve` end to end on a tiny random model: report structure, exactness, bounds."""

from __future__ import annotations

import json
import threading
import time

import pytest

from quickdraft.bench.serving import (
    JSON_FILE,
    MODES,
    SUMMARY_FILE,
    LevelResult,
    RequestRecord,
    ServingBenchOptions,
    compare_outputs,
    interleave_by_task,
    percentile,
    select_prompts,
)
from quickdraft.bench.specbench import Question
from quickdraft.cli import main

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["abcabcabcabc abc", "again"]},
    {"question_id": 82, "category": "writing", "turns": ["one two one two one two"]},
    {"question_id": 7, "category": "qa", "turns": ["xyzxyzxyzxyz"]},
    {"question_id": 9, "category": "rag", "turns": ["the cat sat; the cat sat; the cat"]},
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

# The replicas test starts Ray: this file runs on the pytest-xdist worker of the other Ray tests.
pytestmark = pytest.mark.xdist_group("ray")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return path


def run_bench(model, questions, out, *extra) -> int:
    return main(
        [
            "bench",
            "serve",
            "--model",
            str(model),
            "--questions",
            str(questions),
            "--max-model-len",
            "128",
            "--max-tokens",
            str(MAX_TOKENS),
            "--speculative-config",
            json.dumps(NGRAM),
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def report(tiny_checkpoints, questions_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-bench")
    threads_before = set(threading.enumerate())
    modes = ("--modes", *MODES)  # ceiling too (not run by default)
    assert run_bench(tiny_checkpoints["gemma3"], questions_file, out, "--concurrency", "1", "2", *modes) == 0
    # Every mode's server (uvicorn thread, engine loop, preprocessing pool) is gone; the pool's
    # threads end on their own after shutdown(wait=False), so they get a moment on a busy machine.
    # A server's "kernel-builds" thread is the process's, not the server's: it builds the C++
    # kernels once for the process (minutes on a fresh machine) and ends by itself.
    deadline = time.monotonic() + 10
    while (
        left := {t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()} - {"kernel-builds"}
    ) and (time.monotonic() < deadline):
        time.sleep(0.05)
    assert left == set()
    return out, json.loads((out / JSON_FILE).read_text()), (out / SUMMARY_FILE).read_text()


def levels_by_key(data) -> dict[tuple[str, int], dict]:
    return {(level["mode"], level["concurrency"]): level for level in data["levels"]}


def test_every_mode_runs_every_level_in_full(report):
    _, data, _ = report
    levels = levels_by_key(data)
    assert set(levels) == {(mode, c) for mode in MODES for c in (1, 2)}
    for (_mode, concurrency), level in levels.items():
        assert level["planned"] == concurrency * 2 and not level["stopped_by_time_limit"]
        assert [r["index"] for r in level["requests"]] == list(range(concurrency * 2))
        summary = level["summary"]
        assert summary["requests_ok"] == concurrency * 2 and summary["errors"] == 0
        assert summary["output_tokens"] == sum(len(r["token_ids"]) for r in level["requests"]) > 0
        assert summary["tokens_per_second"] == pytest.approx(summary["output_tokens"] / level["wall_seconds"])
        for request in level["requests"]:
            assert 0 < len(request["token_ids"]) <= MAX_TOKENS and request["finish_reason"] in ("stop", "length")
            assert request["ttft"] is not None and request["ttft"] <= request["seconds"]
        assert summary["ttft_p50"] <= summary["ttft_p90"]


def test_requests_cycle_through_interleaved_tasks(report):
    _, data, _ = report
    level = levels_by_key(data)[("off", 2)]
    # Round robin over tasks (multi-turn, qa, rag), then the second writing question, cycled.
    assert [r["question_id"] for r in level["requests"]] == [81, 7, 9, 82]
    assert [r["task"] for r in level["requests"]] == ["multi-turn", "qa", "rag", "multi-turn"]


def test_greedy_outputs_are_identical_in_every_mode(report, tiny_checkpoints):
    from quickdraft import LLM
    from quickdraft.bench.specbench import conversation_prompt
    from quickdraft.sampling_params import SamplingParams

    _, data, summary_md = report
    levels = levels_by_key(data)
    for mode in ("always-on", "adaptive", "ceiling"):
        for concurrency in (1, 2):
            summary = levels[(mode, concurrency)]["summary"]
            assert summary["exact"] is True and summary["compared"] == concurrency * 2 and summary["differing"] == []
        assert data["exact_vs_off"][mode] == "yes (6 requests)"
        assert f"- {mode}: yes (6 requests)" in summary_md
    # "off" itself answers as offline plain decoding does, so the comparison means something.
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128)
    texts = {q["question_id"]: conversation_prompt(q["turns"][:1], []) for q in QUESTIONS}
    off = levels[("off", 2)]["requests"]
    expected = llm.generate(
        [texts[r["question_id"]] for r in off], SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    )
    assert [r["token_ids"] for r in off] == [o.outputs[0].token_ids for o in expected]


def test_speculation_figures_come_from_the_server(report):
    _, data, _ = report
    levels = levels_by_key(data)
    for concurrency in (1, 2):
        off, always, adaptive, ceiling = (levels[(mode, concurrency)] for mode in MODES)
        assert off["summary"]["draft_tokens"] == 0 and off["summary"]["draft_length_choices"] == []
        assert always["summary"]["draft_tokens"] > 0 and always["summary"]["draft_length_choices"] == []
        assert all(
            r["speculation"]["method"] == "ngram" and not r["speculation"]["adaptive"] for r in always["requests"]
        )
        choices = adaptive["summary"]["draft_length_choices"]
        assert sum(choices) == sum(sum(r["speculation"]["draft_length_choices"]) for r in adaptive["requests"]) > 0
        assert len(choices) <= NGRAM["num_speculative_tokens"] + 1
        assert adaptive["summary"]["plain_step_share"] == pytest.approx(choices[0] / sum(choices))
        # ceiling: an engine without a drafter (method "none") whose requests draft off's own
        # answers, their predictions (the random model's text re-encodes to other tokens mostly)
        assert all(r["speculation"]["method"] == "none" for r in ceiling["requests"])
        assert ceiling["summary"]["accepted_tokens"] > 0
        assert off["summary"]["throughput_vs_off"] is None
        assert always["summary"]["throughput_vs_off"] == pytest.approx(
            always["summary"]["tokens_per_second"] / off["summary"]["tokens_per_second"]
        )


def test_ceiling_runs_right_after_off_whatever_the_rotation():
    from quickdraft.bench.serving import _mode_order

    assert _mode_order(list(MODES), 0) == ["off", "ceiling", "always-on", "adaptive"]
    assert _mode_order(list(MODES), 1) == ["always-on", "adaptive", "off", "ceiling"]
    assert _mode_order(["off", "ceiling"], 1) == ["off", "ceiling"]
    assert _mode_order(["off", "always-on"], 1) == ["always-on", "off"]


def test_summary_has_command_machine_and_a_row_per_mode_and_level(report):
    _, data, summary_md = report
    lines = summary_md.splitlines()
    assert lines[0].startswith("# Serving benchmark:")
    assert "`quickdraft bench serve --model" in summary_md and data["command"].startswith("quickdraft bench serve")
    assert any(line.startswith("Machine: ") and "CPUs" in line for line in lines) and data["machine"]
    for mode in MODES:
        for concurrency in (1, 2):
            rows = [line for line in lines if line.startswith(f"| {concurrency} | {mode} |")]
            assert len(rows) == (1 if mode == "off" else 2), (mode, concurrency)  # off has no speculation row
    assert "## Notes" not in summary_md  # no time limit reached, no error, no question left out


def test_time_limit_stops_new_requests_and_is_reported(tiny_checkpoints, questions_file, tmp_path):
    out = tmp_path / "out"
    assert (
        run_bench(
            tiny_checkpoints["gemma3"],
            questions_file,
            out,
            "--concurrency",
            "2",
            "--requests-per-client",
            "3",
            "--time-limit",
            "0.000001",
            "--modes",
            "off",
            "adaptive",
        )
        == 0
    )
    data = json.loads((out / JSON_FILE).read_text())
    assert [level["mode"] for level in data["levels"]] == ["off", "adaptive"]
    for level in data["levels"]:
        assert level["stopped_by_time_limit"] and len(level["requests"]) == 2 and level["planned"] == 6
    summary_md = (out / SUMMARY_FILE).read_text()
    assert "time limit (1e-06 s per level) reached: adaptive at concurrency 2 sent 2 of 6 requests" in summary_md
    assert "2/6 (time limit)" in summary_md


def test_rounds_ask_new_prompts_and_pool_with_each_rounds_ratio(tiny_checkpoints, questions_file, tmp_path):
    out = tmp_path / "out"
    extra = ["--concurrency", "1", "2", "--requests-per-client", "1", "--rounds", "2", "--modes", "off", "always-on"]
    assert run_bench(tiny_checkpoints["gemma3"], questions_file, out, *extra) == 0
    data = json.loads((out / JSON_FILE).read_text())
    levels = {(x["mode"], x["concurrency"], x["round"]): x for x in data["levels"]}
    assert set(levels) == {(m, c, r) for m in ("off", "always-on") for c in (1, 2) for r in (0, 1)}
    for mode in ("off", "always-on"):
        # round 2 numbers its requests after round 1's: the next prompts of the interleaved order
        assert [q["question_id"] for q in levels[(mode, 1, 0)]["requests"]] == [81]
        assert [q["question_id"] for q in levels[(mode, 1, 1)]["requests"]] == [7]
        assert [q["index"] for q in levels[(mode, 2, 1)]["requests"]] == [2, 3]
    for concurrency in (1, 2):
        for r in (0, 1):  # each round against plain decoding of the same round: the same prompts
            summary = levels[("always-on", concurrency, r)]["summary"]
            assert summary["exact"] is True and summary["compared"] == concurrency
        pooled = {(x["mode"], x["concurrency"]): x for x in data["pooled"]}[("always-on", concurrency)]
        rounds = [levels[("always-on", concurrency, r)] for r in (0, 1)]
        assert pooled["summary"]["requests_ok"] == 2 * concurrency
        assert pooled["wall_seconds"] == pytest.approx(sum(x["wall_seconds"] for x in rounds))
        assert pooled["summary"]["round_ratios"] == [x["summary"]["throughput_vs_off"] for x in rounds]
        off = {(x["mode"], x["concurrency"]): x for x in data["pooled"]}[("off", concurrency)]
        assert pooled["summary"]["throughput_vs_off"] == pytest.approx(
            pooled["summary"]["tokens_per_second"] / off["summary"]["tokens_per_second"]
        )
    summary_md = (out / SUMMARY_FILE).read_text()
    assert "| vs off by round |" in summary_md
    row = next(line for line in summary_md.splitlines() if line.startswith("| 2 | always-on |"))
    ratios = [x["summary"]["throughput_vs_off"] for x in (levels[("always-on", 2, r)] for r in (0, 1))]
    assert f"| {ratios[0]:.2f}, {ratios[1]:.2f} |" in row


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--speculative-config", '{"method": "ngram", "adaptive": true}'], "without 'adaptive'"),
        (["--speculative-config", '{"method": "ngram", "dynamic_draft_length": true}'], "choose one"),
        (["--speculative-config", "[1]"], "must be a JSON object"),
        (["--speculative-config", '{"method": "ngram"}', "--concurrency", "0"], "concurrency must be an integer >= 1"),
        (["--speculative-config", '{"method": "ngram"}', "--concurrency", "2", "2"], "distinct"),
        (["--speculative-config", '{"method": "ngram"}', "--time-limit", "0"], "time_limit_seconds must be"),
        (["--speculative-config", '{"method": "ngram"}', "--rounds", "0"], "rounds must be an integer >= 1"),
        (["--speculative-config", '{"method": "ngram"}', "--questions", "/nonexistent.jsonl"], "not found"),
        (["--speculative-config", '{"method": "ngram"}', "--modes", "adaptive"], "must include 'off'"),
        (["--speculative-config", '{"method": "ngram"}', "--modes", "off", "fast"], "modes must be distinct names"),
    ],
)
def test_bad_options_are_clear_errors(extra, message, capsys):
    assert main(["bench", "serve", *extra]) == 2
    assert message in capsys.readouterr().err


def test_options_validate_without_the_cli():
    with pytest.raises(ValueError, match="requests_per_client"):
        ServingBenchOptions(speculative_config=NGRAM, requests_per_client=0)
    with pytest.raises(ValueError, match="needs at least one level"):
        ServingBenchOptions(speculative_config=NGRAM, concurrency=())
    with pytest.raises(ValueError, match=r"clients must be one of \['process', 'thread'\], got 'remote'"):
        ServingBenchOptions(speculative_config=NGRAM, clients="remote")
    modes = ServingBenchOptions(speculative_config=NGRAM, concurrency=(3, 1)).mode_configs()
    assert modes == {"off": None, "always-on": NGRAM, "adaptive": {**NGRAM, "adaptive": True}}
    chosen = ServingBenchOptions(speculative_config=NGRAM, modes=("adaptive", "off")).mode_configs()
    assert list(chosen) == ["off", "adaptive"]  # off runs first whatever the order given


def test_prompts_that_do_not_fit_are_left_out_and_named():
    questions = [
        Question(question_id=1, category="qa", turns=["short"]),
        Question(question_id=2, category="rag", turns=["long " * 50]),
    ]
    prompts, skipped = select_prompts(questions, count_tokens=len, max_model_len=100, max_tokens=10)
    assert [p.question_id for p in prompts] == [1] and skipped == [2]
    with pytest.raises(ValueError, match="no question's first turn fits max_model_len 10"):
        select_prompts(questions, count_tokens=len, max_model_len=10, max_tokens=10)


def test_interleave_by_task_takes_turns_in_spec_bench_order():
    questions = [
        Question(question_id=i, category=c, turns=["t"])
        for i, c in enumerate(["rag", "rag", "coding", "writing", "qa", "translation"])
    ]
    assert [q.question_id for q in interleave_by_task(questions)] == [2, 5, 4, 0, 3, 1]


def test_compare_outputs_finds_a_differing_request():
    def level(mode, outputs):
        return LevelResult(
            mode=mode,
            concurrency=1,
            planned=len(outputs),
            wall_seconds=1.0,
            stopped_by_time_limit=False,
            requests=[
                RequestRecord(index=i, question_id=i, task="qa", token_ids=tokens, finish_reason="length")
                for i, tokens in enumerate(outputs)
            ],
        )

    baseline = level("off", [[1, 2], [3, 4], [5]])
    assert compare_outputs(level("adaptive", [[1, 2], [3, 4], [5]]), baseline=baseline) == dict(
        exact=True, compared=3, differing=[]
    )
    assert compare_outputs(level("adaptive", [[1, 2], [3, 9], [5]]), baseline=baseline) == dict(
        exact=False, compared=3, differing=[1]
    )
    assert compare_outputs(level("off", []), baseline=None)["exact"] is None


def test_percentile_interpolates_like_numpy():
    import numpy

    values = [0.3, 0.1, 0.7, 0.2, 0.9]
    for fraction in (0.0, 0.5, 0.9, 1.0):
        assert percentile(values, fraction) == pytest.approx(numpy.percentile(values, fraction * 100))
    assert percentile([], 0.5) is None and percentile([4.0], 0.9) == 4.0


def test_bench_serve_on_replicas_gives_the_single_servers_tokens(report, tiny_checkpoints, questions_file, tmp_path):
    """`--replicas 2`: each mode deployed on Ray Serve; same prompts, same greedy tokens as the single server."""
    _, single, _ = report
    extra = ("--concurrency", "2", "--modes", "off", "--replicas", "2")
    assert run_bench(tiny_checkpoints["gemma3"], questions_file, tmp_path, *extra) == 0
    data = json.loads((tmp_path / JSON_FILE).read_text())
    assert "2 replicas on Ray Serve (1 CPUs each, cache_aware routing)" in data["header"]
    assert data["options"]["replicas"] == 2
    single_levels = levels_by_key(single)
    for key, level in levels_by_key(data).items():
        assert level["summary"]["errors"] == 0
        tokens = {r["index"]: r["token_ids"] for r in level["requests"]}
        expected = {r["index"]: r["token_ids"] for r in single_levels[key]["requests"]}
        assert tokens == expected


def test_clients_on_the_servers_thread_give_the_same_tokens(report, tiny_checkpoints, questions_file, tmp_path):
    """The report fixture's clients ran in a process of their own (the default); `--clients thread`
    runs them in the server's process: same prompts, same greedy tokens, and each header says where."""
    _, in_own_process, _ = report
    assert "clients in a process of their own" in in_own_process["header"]
    assert (
        run_bench(
            tiny_checkpoints["gemma3"],
            questions_file,
            tmp_path,
            *"--concurrency 2 --modes off --clients thread".split(),
        )
        == 0
    )
    data = json.loads((tmp_path / JSON_FILE).read_text())
    assert "clients in the server's process (main thread)" in data["header"]
    assert data["options"]["clients"] == "thread"
    expected = levels_by_key(in_own_process)[("off", 2)]
    level = levels_by_key(data)[("off", 2)]
    assert level["summary"]["errors"] == 0
    assert {r["index"]: r["token_ids"] for r in level["requests"]} == {
        r["index"]: r["token_ids"] for r in expected["requests"]
    }


def test_requests_run_lora_adapters_in_turn_and_stay_exact(tiny_checkpoints, questions_file, tmp_path):
    """--lora-modules: request n names adapter n % 2; speculation gives each request the tokens
    plain decoding gives it, and those are LLM.generate's under that adapter."""
    from quickdraft import LLM, LoRARequest
    from quickdraft.bench.specbench import conversation_prompt
    from quickdraft.sampling_params import SamplingParams
    from tests.models.test_lora import write_peft_adapter

    base = tiny_checkpoints["gemma3"]
    paths = [write_peft_adapter(base, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    out = tmp_path / "out"
    extra = ["--concurrency", "2", "--requests-per-client", "1", "--modes", "off", "always-on", "--max-loras", "2"]
    extra += ["--lora-modules", f"one={paths[0]}", f"two={paths[1]}"]
    assert run_bench(base, questions_file, out, *extra) == 0
    data = json.loads((out / JSON_FILE).read_text())
    levels = levels_by_key(data)
    assert levels[("always-on", 2)]["summary"]["exact"] is True
    off = levels[("off", 2)]["requests"]
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_loras=2)
    texts = {q["question_id"]: conversation_prompt(q["turns"][:1], []) for q in QUESTIONS}
    adapters = [LoRARequest("one", 1, str(paths[0])), LoRARequest("two", 2, str(paths[1]))]
    expected = llm.generate(
        [texts[r["question_id"]] for r in off],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        lora_request=[adapters[r["index"] % 2] for r in off],
    )
    assert [r["token_ids"] for r in off] == [o.outputs[0].token_ids for o in expected]
    assert "requests run LoRA adapters in turn (one, two; max_loras 2)" in (out / SUMMARY_FILE).read_text()


def test_requests_name_lora_modules_as_serve_parses_them():
    options = ServingBenchOptions(speculative_config=NGRAM, lora_modules=('{"name": "x", "path": "/p"}', "y=/q"))
    assert [options.request_model(i) for i in range(3)] == ["x", "y", "x"]
