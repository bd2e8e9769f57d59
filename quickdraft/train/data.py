"""Training data for draft heads, built offline from the target itself.

Prompts come from text every Python installation has (the stdlib's documentation topics and
module docstrings), wrapped in task templates (summarise, translate, explain, answer from a
passage, write, solve a word problem) and in the "User: ...\\nAssistant:" transcript form the
benchmarks use.  The target answers them (so a head learns what the target actually says),
and a feature recorder captures the target's hidden states of every token as it enters the
cache, during that same generation: no second pass over the data.

Spec-Bench questions are never used here, so heads can be measured on them fairly.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Dutch")
WRITING = (
    "a short story",
    "a poem",
    "a product description",
    "an email to a colleague",
    "a blog post intro",
    "a dialogue between two friends",
    "a persuasive paragraph",
    "a short speech",
)
TOPICS = (
    "a lighthouse keeper",
    "the first day of spring",
    "a lost umbrella",
    "a robot learning to cook",
    "a mountain village",
    "an old library",
    "a city at night",
    "a chess tournament",
    "the ocean",
    "a new coffee shop",
    "learning a language",
    "a rainy afternoon",
    "space travel",
    "a garden",
    "a train journey",
    "friendship",
    "a museum visit",
    "winter holidays",
    "a science fair",
)


def text_snippets() -> tuple[list[str], list[str]]:
    """(paragraphs, sentences) from the Python documentation shipped with the interpreter."""
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    for name in (
        "collections",
        "itertools",
        "functools",
        "json",
        "re",
        "pathlib",
        "datetime",
        "statistics",
        "random",
        "string",
        "textwrap",
        "heapq",
        "bisect",
        "argparse",
        "logging",
        "unittest",
        "sqlite3",
        "csv",
        "decimal",
        "fractions",
        "math",
        "os",
        "shutil",
        "subprocess",
        "threading",
        "asyncio",
        "typing",
        "dataclasses",
        "enum",
        "inspect",
        "contextlib",
        "abc",
        "http.client",
        "urllib.parse",
        "email",
        "zipfile",
        "tarfile",
        "hashlib",
        "secrets",
        "uuid",
        "calendar",
    ):
        try:
            module = __import__(name, fromlist=["_"])
        except ImportError:
            continue
        texts.append(module.__doc__ or "")
        with warnings.catch_warnings():  # some attributes are deprecated aliases that warn when touched
            warnings.simplefilter("ignore")
            for attr in dir(module):
                doc = getattr(getattr(module, attr, None), "__doc__", None)
                if isinstance(doc, str) and len(doc) > 200 and not attr.startswith("_"):
                    texts.append(doc)
    paragraphs, sentences = [], []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if (
                200 <= len(block) <= 1200
                and block.count(">>>") == 0
                and sum(c.isalpha() for c in block) > 0.7 * len(block)
            ):
                paragraphs.append(block)
                sentences += [s for s in re.split(r"(?<=[.!?])\s+", block) if 40 <= len(s) <= 200]
    return sorted(set(paragraphs)), sorted(set(sentences))


def word_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 25), rng.randint(2, 9)
    item, person = (
        rng.choice(["apples", "books", "pencils", "tickets", "cookies", "boxes"]),
        rng.choice(["Maria", "Tom", "Aisha", "Ken", "Lena", "Omar"]),
    )
    templates = [
        f"{person} buys {a} {item} at ${b} each and pays with a ${a * b + rng.randint(1, 50)} bill. "
        f"How much change does {person} get?",
        f"A class has {a} students. Each student brings {c} {item}. The teacher adds {b} more. "
        f"How many {item} are there?",
        f"{person} reads {b} pages a day. How many days does it take to read a book of {a * b + c} pages?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed? Then how far does it go in {b} hours?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"{person} has {a} {item}. {person} gives {c} to each of {b % 5 + 2} friends and buys {b} more. "
        f"How many {item} does {person} have now?",
        f"A shop sells {item} for ${c} each. On Monday it sells {a}, on Tuesday twice as many. "
        f"How much money does it make over the two days?",
        f"{person} works {c} hours a day at ${b} an hour, {rng.randint(3, 6)} days a week. "
        f"How much does {person} earn in a week?",
    ]
    return rng.choice(templates)


PROMPT_MIXES = ("docs", "tasks", "articles")
MIXES_ON_TRANSCRIPTS = ("articles",)  # mixes built on earlier data's transcripts


def build_prompts(count: int, *, seed: int, mix: str = "tasks", transcripts: list[str] = ()) -> list[str]:
    """`count` transcript prompts.  "docs" (the first heads' data): task templates over the Python
    documentation.  "tasks": the shapes of common assistant benchmarks written over local text
    (German sentences from the system's gettext catalogues, passages from the Python docs,
    templated questions and word problems, writing/roleplay/reasoning/coding requests).
    "articles": long contexts and second turns built on `transcripts` (earlier "User: ...
    Assistant: ..." sequences, the target's own answers): articles of several passages to
    summarise or to answer a question about, and follow-up requests after a finished turn."""
    if mix not in PROMPT_MIXES:
        raise ValueError(f"unknown prompt mix {mix!r}; choose one of {list(PROMPT_MIXES)}")
    rng = random.Random(seed)
    paragraphs, sentences = text_snippets()
    if mix == "articles":
        return _article_prompts(count, rng=rng, transcripts=transcripts, paragraphs=paragraphs)
    makers = (
        _docs_makers(rng, paragraphs, sentences)
        if mix == "docs"
        else _task_makers(rng, paragraphs, sentences, german_sentences())
    )
    return [f"User: {rng.choice(makers)()}\nAssistant:" for _ in range(count)]


FOLLOW_UPS = (
    "Rewrite your previous answer in fewer words.",
    "Now explain it to a child.",
    "Can you give an example?",
    "Summarize your answer in one sentence.",
    "Translate your answer into French.",
    "What are the weaknesses of your answer?",
    "Make it more formal.",
    "Now write it as a list of bullet points.",
    "Add a title and a conclusion.",
    "Why is that so? Explain step by step.",
    "Continue the text.",
    "Rewrite it from a different point of view.",
)


def _article_prompts(count: int, *, rng: random.Random, transcripts: list[str], paragraphs: list[str]) -> list[str]:
    answers = [a for a in (answer_text(t) for t in transcripts) if len(a) >= 200 and is_prose(a)]
    finished = [t.rstrip() for t in transcripts if len(answer_text(t)) >= 40]
    if not answers or not finished:
        raise ValueError(
            "the articles mix builds on earlier answers: give transcripts (train-head: --extra-data) "
            "with answers of at least 200 characters"
        )

    def passage() -> str:  # the target's own prose, or a documentation paragraph
        return rng.choice(answers) if rng.random() < 0.6 else rng.choice(paragraphs)

    def article() -> str:
        return " ".join(passage() for _ in range(rng.randint(4, 8)))

    def titled_passages() -> tuple[str, list[str]]:
        chosen = [passage() for _ in range(rng.randint(4, 6))]
        titles = [" ".join(p.split()[: rng.randint(2, 5)]).strip(".,:;") for p in chosen]
        return " ".join(f"{t} {p}" for t, p in zip(titles, chosen)), titles

    def question_over_passages() -> str:
        text, titles = titled_passages()
        question = rng.choice(
            [
                f"What is {rng.choice(titles)}?",
                f"What does the text say about {rng.choice(titles)}?",
                f"Who or what is {rng.choice(titles)} according to the passage?",
                trivia_question(rng),
            ]
        )
        return f"{text}\n{question}"

    prompts = []
    for _ in range(count):
        kind = rng.choice(("summary", "summary", "passages", "passages", "second turn", "second turn"))
        if kind == "second turn":
            prompts.append(f"{rng.choice(finished)}\nUser: {rng.choice(FOLLOW_UPS)}\nAssistant:")
        else:
            body = f"Summarize: {article()}" if kind == "summary" else question_over_passages()
            prompts.append(f"User: {body}\nAssistant:")
    return prompts


def is_prose(text: str) -> bool:
    """Mostly letters and not looping: a passage worth reading (base models often repeat themselves)."""
    words = text.split()
    trigrams = list(zip(words, words[1:], words[2:]))
    return sum(c.isalpha() for c in text) > 0.7 * len(text) and len(set(trigrams)) > 0.8 * len(trigrams)


def answer_text(transcript: str) -> str:
    """The last assistant answer of a "User: ...\nAssistant: ..." transcript."""
    return " ".join(transcript.rsplit("Assistant:", 1)[-1].split())


def _docs_makers(rng: random.Random, paragraphs: list[str], sentences: list[str]) -> list:
    return [
        lambda: f"Summarize the following text in a few sentences.\n\n{rng.choice(paragraphs)}",
        lambda: f"Translate the following sentence into {rng.choice(LANGUAGES)}: {rng.choice(sentences)}",
        lambda: f"Explain in simple terms: {rng.choice(sentences)}",
        lambda: (
            f"Read the passage and answer the question.\n\nPassage: {rng.choice(paragraphs)}\n\n"
            f"Question: What is the main point of this passage?"
        ),
        lambda: f"Write {rng.choice(WRITING)} about {rng.choice(TOPICS)}.",
        lambda: f"{word_problem(rng)} Let's think step by step.",
        lambda: f"What does this mean, and when would you use it? {rng.choice(sentences)}",
        lambda: f"Give three tips about {rng.choice(TOPICS)}.",
    ]


def _task_makers(rng: random.Random, paragraphs: list[str], sentences: list[str], german: list[str]) -> list:
    def passages(low: int, high: int) -> str:
        return " ".join(rng.sample(paragraphs, rng.randint(low, high)))

    # Weighted like the benchmark mix: summaries, passage questions, word problems and translation
    # are each about a sixth of it, open requests of every kind the rest.
    makers = [
        lambda: f"Summarize: {passages(1, 3)}",
        lambda: f"{passages(1, 3)}\n{trivia_question(rng)}",
        lambda: word_problem(rng),
    ] * 2 + [
        lambda: trivia_question(rng),
        lambda: f"Write {rng.choice(WRITING)} about {rng.choice(TOPICS)}.",
        lambda: f"Write a news article about {rng.choice(TOPICS)}.",
        lambda: f"Embrace the role of {rng.choice(ROLES)}. {trivia_question(rng)}",
        lambda: f"{rng.choice(REQUESTS)} {rng.choice(TOPICS)}.",
        lambda: f"Write a {rng.choice(LANGUAGES_CODE)} function that {rng.choice(CODE_TASKS)}.",
        lambda: f"Explain in simple terms: {rng.choice(sentences)}",
    ]
    if german:
        makers += [lambda: f"Translate German to English: {rng.choice(german)}"] * 2
    return makers


ROLES = (
    "a pirate captain",
    "a famous detective",
    "a medieval knight",
    "a friendly doctor",
    "a strict teacher",
    "a travel guide in Rome",
    "a chef",
    "an astronaut",
    "a sports coach",
    "a wise old wizard",
)
REQUESTS = (
    "Give three tips about",
    "Describe the pros and cons of",
    "Compare two ways of thinking about",
    "Explain to a child",
    "What are common misconceptions about",
    "Write a short review of",
    "List five facts about",
    "Plan a weekend around",
)
LANGUAGES_CODE = ("Python", "C++", "JavaScript", "Java")
CODE_TASKS = (
    "reverses a string",
    "finds the nth Fibonacci number",
    "checks whether a number is prime",
    "sorts a list of numbers",
    "counts the words in a text",
    "finds the largest element of an array",
    "merges two sorted lists",
    "computes the factorial of n",
    "removes duplicates from a list",
)
COUNTRIES = (
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Australia",
    "Mexico",
    "Norway",
    "Kenya",
    "Italy",
    "Germany",
    "Spain",
    "China",
    "Argentina",
    "Greece",
    "Turkey",
    "Sweden",
    "Peru",
    "Vietnam",
)
THINGS = (
    "the telephone",
    "the printing press",
    "the light bulb",
    "penicillin",
    "the steam engine",
    "the World Wide Web",
    "the airplane",
    "the bicycle",
    "the camera",
    "the radio",
    "the vaccine",
)
EVENTS = (
    "the first Olympic Games",
    "the moon landing",
    "the fall of the Berlin Wall",
    "the French Revolution",
    "the first World Cup",
    "the invention of writing",
    "the building of the pyramids",
)
SUBJECTS = (
    "the song Yesterday",
    "the novel Moby Dick",
    "the movie Titanic",
    "the Mona Lisa",
    "the TV show Friends",
    "the opera Carmen",
    "the game of chess",
    "the Harry Potter books",
)


def trivia_question(rng: random.Random) -> str:
    templates = [
        lambda: f"What is the capital of {rng.choice(COUNTRIES)}?",
        lambda: f"Who invented {rng.choice(THINGS)}?",
        lambda: f"When did {rng.choice(EVENTS)} happen?",
        lambda: f"Who wrote {rng.choice(SUBJECTS)}?",
        lambda: f"Where is {rng.choice(COUNTRIES)} located on a map?",
        lambda: f"What language do people speak in {rng.choice(COUNTRIES)}?",
        lambda: f"Who plays the lead role in {rng.choice(SUBJECTS)}?",
        lambda: f"Why is {rng.choice(TOPICS)} important?",
    ]
    return rng.choice(templates)()


def german_sentences() -> list[str]:
    """German sentences from the system's gettext catalogues (empty where there are none)."""
    import gettext
    from glob import glob

    found = set()
    for path in sorted(glob("/usr/share/locale/de/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # a catalogue in another encoding or damaged: not needed
        for text in catalog.values():
            if (
                isinstance(text, str)
                and 40 <= len(text) <= 200
                and " " in text
                and "%" not in text
                and "\n" not in text
            ):
                found.add(text)
    return sorted(found)


class FeatureRecorder:
    """A drafter that never drafts: it keeps the target features of every cached token."""

    def __init__(self, feature_layers: tuple[int, ...]):
        self.feature_layers = tuple(feature_layers)
        self.features: dict[str, list[torch.Tensor]] = {}

    def begin(self, request) -> None:
        self.features[request.request_id] = []

    def observe(self, request, features: torch.Tensor) -> None:  # features [n, L * D]
        self.features[request.request_id].append(features.to(torch.bfloat16))

    def propose(self, requests):
        return [None] * len(requests)

    def accept(self, request, accepted) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass  # kept until `take` collects them


@dataclass
class Sequence:
    token_ids: list[int]  # prompt + answer
    num_prompt_tokens: int
    features: torch.Tensor  # [len(token_ids) - 1, L * D] bf16: every token but the last

    @property
    def num_answer_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def with_features(self, features: torch.Tensor) -> Sequence:
        return Sequence(token_ids=self.token_ids, num_prompt_tokens=self.num_prompt_tokens, features=features)


@dataclass
class DataShard:
    sequences: list[Sequence] = field(default_factory=list)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors, meta = {}, []
        for i, s in enumerate(self.sequences):
            tensors[f"tokens.{i}"] = torch.tensor(s.token_ids, dtype=torch.int32)
            tensors[f"features.{i}"] = s.features.contiguous()
            meta.append(s.num_prompt_tokens)
        save_file(tensors, str(path), metadata={"num_prompt_tokens": json.dumps(meta)})

    @classmethod
    def load(cls, path: Path) -> DataShard:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["num_prompt_tokens"])
        tensors = load_file(str(path))
        return cls(
            [
                Sequence(
                    token_ids=tensors[f"tokens.{i}"].tolist(), num_prompt_tokens=n, features=tensors[f"features.{i}"]
                )
                for i, n in enumerate(meta)
            ]
        )


def generate_shard(
    llm, prompts: list[str], *, feature_layers: tuple[int, ...], max_new_tokens: int, temperature: float, seed: int
) -> DataShard:
    """The target answers `prompts` (batched); returns the sequences with their features."""
    from quickdraft.sampling_params import SamplingParams

    recorder = FeatureRecorder(feature_layers)
    llm.engine.set_drafter(recorder)
    try:
        params = [
            SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
            for i in range(len(prompts))
        ]
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.set_speculative_config(None)
    shard = DataShard()
    for output in outputs:
        tokens = output.prompt_token_ids + output.outputs[0].token_ids
        features = torch.cat(recorder.features.pop(output.request_id))
        shard.sequences.append(
            Sequence(
                token_ids=tokens, num_prompt_tokens=len(output.prompt_token_ids), features=features[: len(tokens) - 1]
            )
        )
    return shard
