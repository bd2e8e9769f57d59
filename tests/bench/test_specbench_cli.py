"""`quickdraft bench specbench` end to end on a tiny random model: files, tables and figures agree."""

from __future__ import annotations

import json

import pytest

from quickdraft.bench.report import ACCEPTANCE_PLOT, JSON_FILE, SPEEDUP_PLOT, SUMMARY_FILE
from quickdraft.bench.specbench import TASKS, task_of
from quickdraft.cli import main

pytest.importorskip("matplotlib")

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["abcabcabcabc abc", "again: abcabc"]},
    {"question_id": 7, "category": "qa", "turns": ["xyzxyzxyzxyz"]},
]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return path


def run_bench(model, questions, out, *extra):
    return main(
        [
            "bench",
            "specbench",
            "--questions",
            str(questions),
            "--model",
            str(model),
            "--max-new-tokens",
            "12",
            "--max-model-len",
            "256",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def greedy_report(tiny_checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    questions = tmp / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    out = tmp / "out"
    code = run_bench(
        tiny_checkpoints["gemma3"],
        questions,
        out,
        "--speculative-config",
        NGRAM,
        "--speculative-config",
        '{"method": "suffix"}',
        "--peers",
        "transformers",
        "llama-cpp",
    )
    assert code == 0
    return out, json.loads((out / JSON_FILE).read_text())


def runs_by_name(data):
    return {run["name"]: run for run in data["runs"]}


def test_every_output_file_is_written(greedy_report):
    out, _ = greedy_report
    for name in (SUMMARY_FILE, JSON_FILE):
        assert (out / name).stat().st_size > 0
    for name in (SPEEDUP_PLOT, ACCEPTANCE_PLOT):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_cover_plain_methods_and_peers(greedy_report):
    _, data = greedy_report
    runs = runs_by_name(data)
    assert list(runs)[:3] == ["quickdraft plain", "quickdraft ngram num_speculative_tokens=4", "quickdraft suffix"]
    assert {"transformers plain", "transformers prompt lookup", "llama.cpp plain", "llama.cpp prompt lookup"} <= set(
        runs
    )
    for name in ("transformers plain", "transformers prompt lookup"):
        assert runs[name]["error"] is None, runs[name]["error"]
    # llama.cpp reads GGUF only: on an HF directory it is reported with the reason, not dropped.
    for name in ("llama.cpp plain", "llama.cpp prompt lookup"):
        assert runs[name]["error"] and ("GGUF" in runs[name]["error"] or "not installed" in runs[name]["error"])
        assert runs[name]["summary"] is None


def test_figures_follow_their_definitions(greedy_report):
    _, data = greedy_report
    runs = runs_by_name(data)
    plain = runs["quickdraft plain"]["questions"]
    for run in runs.values():
        if run["error"]:
            continue
        questions = run["questions"]
        assert [q["question_id"] for q in questions] == [81, 7]
        assert [len(q["turns"]) for q in questions] == [2, 1]  # multi-turn answered turn by turn
        for task, row in run["summary"].items():
            picked = [i for i, q in enumerate(questions) if task == "overall" or task_of(q["category"]) == task]
            seconds = sum(questions[i]["seconds"] for i in picked)
            tokens = sum(len(t["token_ids"]) for i in picked for t in questions[i]["turns"])
            plain_tokens = sum(plain[i]["new_tokens"] for i in picked)
            plain_seconds = sum(plain[i]["seconds"] for i in picked)
            assert row["speedup"] == pytest.approx((tokens / seconds) / (plain_tokens / plain_seconds))
            if tokens == plain_tokens:  # same answers (greedy speculation): plain time / run time
                assert row["speedup"] == pytest.approx(plain_seconds / seconds)
            forwards = sum(t["target_forwards"] for i in picked for t in questions[i]["turns"])
            assert row["new_tokens"] == tokens
            assert row["mean_accepted_tokens"] == pytest.approx(tokens / forwards)
            firsts = [questions[i]["turns"][0]["ttft"] for i in picked]
            laters = [t["ttft"] for i in picked for t in questions[i]["turns"][1:]]
            assert row["ttft_first_turns"] == pytest.approx(sum(firsts) / len(firsts))
            assert row["ttft_later_turns"] == (pytest.approx(sum(laters) / len(laters)) if laters else None)
        assert list(run["summary"]) == ["multi-turn", "qa", "overall"]
        assert set(run["summary"]) - {"overall"} <= set(TASKS)


def test_speculation_is_exact_and_counted(greedy_report):
    _, data = greedy_report
    runs = runs_by_name(data)
    plain = runs["quickdraft plain"]
    assert plain["summary"]["overall"]["mean_accepted_tokens"] == pytest.approx(1.0)
    for name in ("quickdraft ngram num_speculative_tokens=4", "quickdraft suffix"):
        run = runs[name]
        assert run["summary"]["overall"]["exact_match"] == 1.0
        assert run["summary"]["overall"]["mean_accepted_tokens"] > 1.0  # the prompts repeat themselves
        accepted = drafted = 0
        for question in run["questions"]:
            for turn in question["turns"]:
                accepted += turn["accepted_per_position"][0] if turn["accepted_per_position"] else 0
                drafted += turn["drafted_per_position"][0] if turn["drafted_per_position"] else 0
        assert run["acceptance_by_position"][0] == pytest.approx(accepted / drafted)
        assert run["drafter_memory_bytes"] is not None
    lookup = runs["transformers prompt lookup"]["summary"]["overall"]
    assert lookup["exact_match"] is not None and lookup["speedup_vs_reference"] > 0


def test_summary_table_lists_every_run(greedy_report):
    out, data = greedy_report
    text = (out / SUMMARY_FILE).read_text()
    assert "quickdraft bench specbench" in text  # the command line that produced it
    for run in data["runs"]:
        assert run["name"] in text
    assert "did not finish" in text and "llama.cpp plain:" in text
    ngram_row = next(line for line in text.splitlines() if line.startswith("| quickdraft ngram"))
    overall = runs_by_name(data)["quickdraft ngram num_speculative_tokens=4"]["summary"]["overall"]
    assert f"{overall['speedup']:.2f}x ({overall['mean_accepted_tokens']:.2f})" in ngram_row
    ttft_section = text.split("## Time to first token by task")[1].split("## ")[0]
    ngram_ttft = next(line for line in ttft_section.splitlines() if line.startswith("| quickdraft ngram"))
    summary = runs_by_name(data)["quickdraft ngram num_speculative_tokens=4"]["summary"]
    multi_turn, qa = summary["multi-turn"], summary["qa"]  # two turns / one
    assert ngram_ttft.split(" | ")[1:3] == [
        f"{multi_turn['ttft_first_turns'] * 1e3:.0f} / {multi_turn['ttft_later_turns'] * 1e3:.0f}",
        f"{qa['ttft_first_turns'] * 1e3:.0f}",
    ]


def test_sampled_run_reports_acceptance_not_exactness(tiny_checkpoints, questions_file, tmp_path, capsys):
    out = tmp_path / "sampled"
    assert (
        run_bench(
            tiny_checkpoints["gemma3"],
            questions_file,
            out,
            "--speculative-config",
            NGRAM,
            "--temperature",
            "0.3",
            "--seed",
            "3",
            "--kv-cache-dtype",
            "float16",
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "temperature 0.3" in printed and "KV cache float16" in printed
    run = runs_by_name(json.loads((out / JSON_FILE).read_text()))["quickdraft ngram num_speculative_tokens=4"]
    assert run["summary"]["overall"]["exact_match"] is None
    assert run["summary"]["overall"]["acceptance_rate"] is not None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--peers", "vllm"], "unknown peers"),
        (["--categories", "poetry"], "unknown categories"),
        (["--speculative-config", "[1]"], "JSON object"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_bad_options_are_clear_errors(tiny_checkpoints, questions_file, tmp_path, capsys, extra, message):
    assert run_bench(tiny_checkpoints["gemma3"], questions_file, tmp_path / "o", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_questions_file_is_named(tmp_path, capsys):
    assert main(["bench", "specbench", "--questions", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_report_command_rebuilds_the_same_tables(greedy_report, tmp_path, capsys):
    import shutil

    out, _data = greedy_report
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / SUMMARY_FILE).unlink()
    (copy / SPEEDUP_PLOT).unlink()
    assert main(["bench", "report", str(copy)]) == 0
    assert (copy / SUMMARY_FILE).read_text() == (out / SUMMARY_FILE).read_text()
    assert (copy / SPEEDUP_PLOT).is_file()
    assert main(["bench", "report", str(tmp_path / "nothing")]) == 2
    assert "results.json" in capsys.readouterr().err


def test_draft_model_config_adds_the_transformers_assistant_peer(tiny_checkpoints, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[1]) + "\n")
    draft = str(tiny_checkpoints["gemma3"])  # the target as its own assistant: a valid draft model
    out = tmp_path / "out"
    assert (
        run_bench(
            tiny_checkpoints["gemma3"],
            questions,
            out,
            "--speculative-config",
            json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3}),
            "--peers",
            "transformers",
            "--peer-draft-tokens",
            "3",
        )
        == 0
    )
    runs = runs_by_name(json.loads((out / JSON_FILE).read_text()))
    assistant = runs[f"transformers assistant {tiny_checkpoints['gemma3'].name}"]
    assert assistant["error"] is None, assistant["error"]
    assert "assistant_model" in assistant["setting"]
    assert assistant["summary"]["overall"]["mean_accepted_tokens"] > 1.0
    ours = next(run for name, run in runs.items() if name.startswith("quickdraft draft_model model=gemma3"))
    assert ours["error"] is None


def test_interleaved_runs_answer_the_same_and_stay_exact(tiny_checkpoints, questions_file, tmp_path):
    out = tmp_path / "interleaved"
    assert (
        run_bench(
            tiny_checkpoints["gemma3"],
            questions_file,
            out,
            "--speculative-config",
            NGRAM,
            "--speculative-config",
            '{"method": "suffix"}',
            "--interleave",
        )
        == 0
    )
    data = json.loads((out / JSON_FILE).read_text())
    assert "interleaved question by question" in data["header"]
    runs = runs_by_name(data)
    plain = runs["quickdraft plain"]
    for name in ("quickdraft ngram num_speculative_tokens=4", "quickdraft suffix"):
        run = runs[name]
        assert run["error"] is None
        assert [q["question_id"] for q in run["questions"]] == [q["question_id"] for q in plain["questions"]]
        assert run["summary"]["overall"]["exact_match"] == 1.0
        assert run["summary"]["overall"]["mean_accepted_tokens"] > 1.0
        assert run["peak_memory_bytes"] is None  # not told apart per run when interleaved


def test_run_labels_are_short_and_configurable():
    from quickdraft.bench.runner import method_label

    assert method_label({"method": "suffix"}) == "suffix"
    assert method_label({"method": "ngram", "num_speculative_tokens": 4}) == "ngram num_speculative_tokens=4"
    assert method_label({"model": "[self]"}) == "self"  # vLLM's spelling, not a draft model
    assert method_label({"model": "[self]", "top_k": 2}) == "self top_k=2"
    hybrid = {
        "method": "hybrid",
        "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1}],
        "skip_after": 2,
        "max_draft_tokens": 12,
    }
    label = method_label(hybrid)
    assert label.startswith("hybrid drafters=suffix+eagle3") and len(label) <= 32
    assert method_label({**hybrid, "label": "hybrid copy"}) == "hybrid copy"


def test_plots_stay_readable_with_many_long_runs(tmp_path):
    from quickdraft.bench.plots import plot_speedup_by_task

    tasks = ["multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag", "overall"]
    summaries = {
        f"quickdraft run number {i} with a long descriptive name": {t: {"speedup": 1 + i / 10} for t in tasks}
        for i in range(9)
    }
    path = tmp_path / "speedup.png"
    plot_speedup_by_task(summaries, path, title="nine runs")
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 1.8 * height  # the axes keep their width beside the legend column
