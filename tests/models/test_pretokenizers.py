"""Byte-level GGUF vocabularies split text as the tokenizers their merges were learned with.

llama.cpp names the split in `tokenizer.ggml.pre`; a wrong split gives other token ids than the
model was trained on, silently.  Each split we know is checked against its owners' own pattern
(Mistral's tekken.json, OpenAI's o200k in tiktoken) run by the `regex` module, and Mistral Nemo's
real Tekken vocabulary (shipped in `mistral-common`), written as llama.cpp's converter writes it,
must give the ids Mistral's own tokenizer gives.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

import gguf
import pytest

from quickdraft.models import tokenizer as tokenizer_module
from quickdraft.models.tokenizer import tokenizer_from_gguf

TEXTS = [
    "Hello World! It's a test, isn't it? I'M SHOUTING and we'll see.",
    "CamelCaseWords and HTTPServer, XMLHttpRequest; snake_case_words.",
    "Numbers: 1234567, 3.14159, 2026-12-06 and 100,000,000.",
    "Paths like /usr/local/bin and https://example.com/a/b?c=d\n\nnew paragraph\r\nwindows line",
    "Ünïcödé: naïve café, Straße, ÉCOLE, Ǆemal, ﬁne ligature, Ωmega.",
    "日本語のテキストと中文字符，한국어 문장도 있습니다。",
    "Mixed\tTabs   and    spaces   \n   indented\n\tcode() { return x+1; }",
    "emoji 🚀🔥 and symbols ©®™ — en–dash … ellipsis «quotes»",
    "Contractions: you've, they're, I'd, she'll, it's, DON'T, We'Re",
    "    leading spaces and trailing spaces    ",
    # where Tekken's ids differ from a Llama 3 split ('d taken as a contraction) and GPT-2's
    "'definitely', she said.\n'done' and 'maybe'.",
    "Edit the paragraph to correct any grammatical errors:\nShe didn't remembers.",
]


def _o200k_pattern(monkeypatch) -> str:
    from tiktoken_ext import openai_public

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})  # no download
    return openai_public.o200k_base()["pat_str"]


def _tekken() -> dict:
    return json.loads((resources.files("mistral_common") / "data" / "tekken_240718.json").read_text())


def _pieces(pre: str, text: str) -> list[str]:
    """How our byte-level tokenizer for `pre` splits `text`, the pieces as text."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(tokenizer_module._PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o"])
def test_split_is_the_owners_pattern(pre, monkeypatch):
    import regex

    pytest.importorskip("tiktoken_ext.openai_public")
    pytest.importorskip("mistral_common")
    reference = _tekken()["config"]["pattern"] if pre == "tekken" else _o200k_pattern(monkeypatch)
    for text in TEXTS:
        assert _pieces(pre, text) == regex.findall(reference, text), text


def test_the_splits_differ_where_their_owners_differ():
    """Tekken keeps digits one by one and splits before capitals; Llama 3 keeps runs of three and
    whole words: a vocabulary read with the wrong one would be cut elsewhere."""
    assert _pieces("tekken", " 2026 HTTPServer") == [" ", "2", "0", "2", "6", " HTTPServer"]
    assert _pieces("gpt-4o", " 2026 HTTPServer") == [" ", "202", "6", " HTTPServer"]
    assert _pieces("llama-bpe", " CamelCase") == [" CamelCase"]
    assert _pieces("tekken", " CamelCase") == [" Camel", "Case"]


def _write_tekken_gguf(path: Path) -> None:
    """Mistral Nemo's vocabulary as llama.cpp's converter writes it: 1,000 control tokens, then the
    ranks' byte strings in GPT-2's byte alphabet with the merges that rebuild them, pre `tekken`."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = _tekken()
    specials = data["config"]["default_num_special_tokens"]
    ranks = {
        base64.b64decode(entry["token_bytes"]): entry["rank"]
        for entry in data["vocab"][: data["config"]["default_vocab_size"] - specials]
    }
    converter = TikTokenConverter.__new__(TikTokenConverter)
    converter.load_tiktoken_bpe = lambda _: ranks
    vocab, merges = converter.extract_vocab_merges_from_model(None)
    tokens = [f"<SPECIAL_{i}>" for i in range(specials)] + sorted(vocab, key=vocab.__getitem__)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL] * specials + [gguf.TokenType.NORMAL] * (len(tokens) - specials)
    writer.add_token_types(types)
    writer.add_token_merges([f"{left} {right}" for left, right in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tekken_vocabulary_gives_mistrals_ids(tmp_path):
    pytest.importorskip("mistral_common")
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    path = tmp_path / "tekken.gguf"
    _write_tekken_gguf(path)
    ours = tokenizer_from_gguf(path)
    theirs = Tekkenizer.from_file(str(resources.files("mistral_common") / "data" / "tekken_240718.json"))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, bos=False, eos=False), text
        assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text
