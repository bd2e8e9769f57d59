"""A grammar compiler over the tiny byte-level tokenizer, to check which texts a constraint takes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def text_compiler(tmp_path_factory):
    """GrammarCompiler with encode / decode of its tokenizer (texts in, texts out)."""
    from quickdraft.models.tokenizer import Tokenizer
    from quickdraft.structured.grammar import GrammarCompiler
    from tests.conftest import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("text_tok")
    write_tiny_tokenizer(folder, bos="<bos>", eos="<eos>", chat=False)
    tokenizer = Tokenizer.from_dir(folder)
    compiler = GrammarCompiler(tokenizer=tokenizer.backend, vocab_size=320, eos_token_ids=[1])
    compiler.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    compiler.decode = tokenizer.decode
    return compiler


def consumed(matcher, compiler, text: str) -> bool:
    """Whether the matcher takes every token of the text."""
    return all(matcher.consume_token(token) for token in compiler.encode(text))


def accepts(compiler, constraint, text: str) -> bool:
    """Whether the constraint takes the whole text as an output."""
    matcher = compiler.matcher_for(constraint).matcher
    return consumed(matcher, compiler, text) and matcher.is_accepting()
