"""Tokenizers: built from GGUF metadata, and the wrapper the engine uses.

A GGUF file has no `tokenizer.json`; it stores the vocabulary, token types, scores and (for
byte-level BPE) merges as `tokenizer.ggml.*` metadata. `tokenizer_from_gguf` rebuilds an equivalent
HF `tokenizers.Tokenizer` from them, which the conversion saves as tokenizer.json.

`Tokenizer` wraps a saved HF tokenizer directory (encode/decode, special ids, chat template) and
`IncrementalDetokenizer` turns a stream of generated ids into a stream of text.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from quickdraft.models.gguf import GGUFFile, open_gguf, read_field
from quickdraft.models.heap import return_free_heap

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`: the merges were learned on text split this way.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Mistral Nemo, Mistral Small 3, Pixtral): words split before capitals, digits
# one by one, "/" kept with a run of punctuation (the `pattern` of its tekken.json).
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (GPT-4o; Phi-4-mini, gpt-oss): Tekken's word rule with English contractions kept
# on the word, and digits in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` names by the split their merges were learned on; the names it
# gives GPT-2's own split (gpt2, mpt, olmo, jais, ...) take the byte-level default below.
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "chatglm-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "stablelm2": _QWEN2_SPLIT,
    "hunyuan": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
_GPT2_SPLIT_NAMES = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion")
# Vocabularies converted from tiktoken ranks (Llama 3, Tekken): a piece that is itself a token is
# that token, whatever the merges would make of it (tiktoken's rule; llama.cpp's ignore_merges).
_WHOLE_PIECE_NAMES = ("llama3", "llama-v3", "llama-bpe", "tekken")


# --------------------------------------------------------------------------------------------------
# Building from GGUF metadata
# --------------------------------------------------------------------------------------------------


@dataclass
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a GGUF file."""

    architecture: str
    model: str  # "llama" (SentencePiece BPE) or "gpt2" (byte-level BPE)
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None = field(default=None, repr=False)
    # llama.cpp's reranker files: the text a (query, document) pair is read as, `{query}` and
    # `{document}` in it (tokenizer.chat_template.rerank)
    rerank_template: str | None = field(default=None, repr=False)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None or token_id >= len(self.tokens) else self.tokens[token_id]


def _as_reader(reader_or_path: GGUFFile | str | Path) -> GGUFFile:
    if isinstance(reader_or_path, GGUFFile):
        return reader_or_path
    return open_gguf(reader_or_path)


def read_gguf_vocab(reader_or_path: GGUFFile | str | Path) -> GGUFVocab:
    reader = _as_reader(reader_or_path)
    key = lambda name, default=None: read_field(reader, f"tokenizer.ggml.{name}", default)  # noqa: E731
    model = key("model")
    tokens = key("tokens")
    if model is None or tokens is None:
        raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    return GGUFVocab(
        architecture=read_field(reader, "general.architecture", ""),
        model=model,
        pre=key("pre"),
        tokens=tokens,
        token_types=key("token_type") or [1] * len(tokens),
        scores=key("scores"),
        merges=key("merges"),
        bos_id=key("bos_token_id"),
        eos_id=key("eos_token_id"),
        unk_id=key("unknown_token_id"),
        pad_id=key("padding_token_id"),
        # llama.cpp adds BOS for SentencePiece vocabularies that don't say otherwise.
        add_bos=bool(key("add_bos_token", model == "llama")),
        add_eos=bool(key("add_eos_token", False)),
        add_space_prefix=bool(key("add_space_prefix", model == "llama")),
        chat_template=read_field(reader, "tokenizer.chat_template"),
        rerank_template=read_field(reader, "tokenizer.chat_template.rerank"),
    )


def derive_merges(vocab: dict[str, int], *, priority: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary, best first.

    Every split of a token into two tokens of the vocabulary is a merge; merges rank by the merged
    token's `priority` (higher first), then by longer left piece (the order transformers'
    `generate_merges` produces, so encodings match it). Linear in the total token length: about
    1.5 s for Gemma's 262k tokens (515k merges).
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in priority.items():
        splits = [
            (token[:cut], token[cut:]) for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in splits)
    # Stable sort, like transformers: ties keep the vocabulary order.
    ranked.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _is_gemma(vocab: GGUFVocab) -> bool:
    return vocab.architecture.startswith("gemma")


def _spiece_tokens(vocab: GGUFVocab) -> list[str]:
    # Gemma quirk 1: llama.cpp stores tokens that are runs of spaces as real spaces ("  "), but the
    # normalizer turns spaces into "▁" before BPE, so spell them "▁▁" or they could never match.
    # With a dummy prefix they stay as stored: llama.cpp splits such user-defined runs off the raw
    # text first and prefixes the text after each, so they are added tokens here (matched before the
    # normalizer, which then prefixes each piece between them) and BPE never forms them from "▁".
    if vocab.add_space_prefix:
        return list(vocab.tokens)
    return [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]


def _sentencepiece_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`): Gemma, Llama 2, Mistral..."""
    tokens = _spiece_tokens(vocab)
    token_ids = {token: index for index, token in enumerate(tokens)}
    if _is_gemma(vocab) or vocab.scores is None:
        # Gemma quirk 2: the file's scores don't follow the merge order; the token order does.
        priority = {token: -float(index) for index, token in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, map(float, vocab.scores)))
    unk = vocab.token(vocab.unk_id)
    model = BPE(
        vocab=token_ids,
        merges=derive_merges(token_ids, priority=priority),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
        dropout=None,
    )
    tokenizer = tokenizers.Tokenizer(model)
    steps: list[decoders.Decoder] = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        # SentencePiece's dummy prefix, added the way llama.cpp does: always (even before a leading
        # space) and after every special token. transformers' Metaspace(prepend_scheme="first") skips
        # both, so it differs from llama.cpp there; decode strips the one prefix space again.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE)]
        )
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        tokenizer.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (byte-level BPE spelling)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): Llama 3, Qwen 2/3..."""
    if not vocab.merges:
        raise ValueError("byte-level BPE GGUF vocabulary has no tokenizer.ggml.merges")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def respell(token: str) -> str:
        # Tokens should already be in the byte alphabet; respell any that aren't, like transformers.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    token_ids = {respell(token): index for index, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ")) for merge in vocab.merges]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError("malformed tokenizer.ggml.merges entry (expected 'left right')")
    tokenizer = tokenizers.Tokenizer(
        BPE(
            vocab=token_ids,
            merges=merges,
            dropout=None,
            fuse_unk=False,
            ignore_merges=vocab.pre in _WHOLE_PIECE_NAMES,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(vocab.pre or "")
    if split is None:
        if vocab.pre is not None and vocab.pre not in _GPT2_SPLIT_NAMES:
            logger.warning("Unknown GGUF pre-tokenizer %r; using GPT-2's split", vocab.pre)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_control_and_user_tokens(tokenizer: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so text
    like "<start_of_turn>" or "\\n\\n" is matched whole instead of being cut by BPE."""
    byte_level = vocab.model == "gpt2"
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.token_types)
        # A control token outside the byte alphabet is a llama.cpp mislabel in byte-level files.
        if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    tokenizer.add_special_tokens(control)
    known = tokenizer.get_vocab(with_added_tokens=True)
    # Space runs respelled to "▁▁" (see _spiece_tokens) are no longer in the vocab as-is: skipped.
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.token_types)
        if kind == _USER_DEFINED and token in known
    ]
    tokenizer.add_tokens(user)


def _template(*, bos: str | None, eos: str | None, sequence: str, type_id: int) -> list[str]:
    """One TemplateProcessing side, e.g. ["<bos>:0", "$A:0"]."""
    pieces = [f"{bos}:{type_id}"] if bos is not None else []
    pieces.append(f"${sequence}:{type_id}")
    return pieces + ([f"{eos}:{type_id}"] if eos is not None else [])


def _set_post_processor(tokenizer: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    """BOS/EOS templates, so plain `tokenizers` / transformers users get the ids llama.cpp would."""
    bos = vocab.token(vocab.bos_id) if vocab.add_bos else None
    eos = vocab.token(vocab.eos_id) if vocab.add_eos else None
    steps: list[processors.PostProcessor] = []
    if vocab.model == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    if bos is not None or eos is not None:
        single = _template(bos=bos, eos=eos, sequence="A", type_id=0)
        pair = single + _template(bos=bos, eos=eos, sequence="B", type_id=1)
        specials = [(token, tokenizer.token_to_id(token)) for token in dict.fromkeys((bos, eos)) if token is not None]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials))
    if steps:
        tokenizer.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)


def tokenizer_from_gguf(reader_or_path: GGUFFile | str | Path) -> tokenizers.Tokenizer:
    """An HF `tokenizers.Tokenizer` equivalent to the tokenizer described by a GGUF file's metadata."""
    vocab = read_gguf_vocab(reader_or_path)
    if vocab.model == "llama":
        tokenizer = _sentencepiece_bpe(vocab)
    elif vocab.model == "gpt2":
        tokenizer = _byte_level_bpe(vocab)
    else:
        raise ValueError(f"Unsupported GGUF tokenizer model {vocab.model!r}; supported: 'llama', 'gpt2'")
    _add_control_and_user_tokens(tokenizer, vocab)
    _set_post_processor(tokenizer, vocab)
    return tokenizer


def tokenizer_config_from_gguf(reader_or_path: GGUFFile | str | Path) -> dict[str, Any]:
    """The `tokenizer_config.json` contents for a GGUF file."""
    vocab = read_gguf_vocab(reader_or_path)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.token(vocab.bos_id),
        "eos_token": vocab.token(vocab.eos_id),
        "unk_token": vocab.token(vocab.unk_id),
        "pad_token": vocab.token(vocab.pad_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    if vocab.rerank_template is not None:  # HF's named templates
        named = [] if vocab.chat_template is None else [{"name": "default", "template": vocab.chat_template}]
        config["chat_template"] = named + [{"name": RERANK_TEMPLATE, "template": vocab.rerank_template}]
    return config


# --------------------------------------------------------------------------------------------------
# The engine's tokenizer
# --------------------------------------------------------------------------------------------------


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"Tokenizer file not found: {path}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot parse {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"Cannot parse {path}: expected a JSON object")
    return data


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json may store special tokens as serialized AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


RERANK_TEMPLATE = "rerank"


def _select_chat_template(template: str | list | None, *, name: str = "default") -> str | None:
    # HF allows a list of named templates; the engine renders plain conversations with "default".
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get(name)
    return template if name == "default" else None


class Tokenizer:
    """An HF tokenizer (tokenizer.json) plus what tokenizer_config/config say about special tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: dict[str, Any] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.config = dict(config or {})
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token_id = self._id_or_none(self.bos_token)
        eos_ids = [self._id_or_none(self.eos_token)] + list(extra_eos_token_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.pad_token_id = self._id_or_none(_token_content(self.config.get("pad_token")))
        self.chat_template = chat_template or _select_chat_template(self.config.get("chat_template"))
        # a reranker's pair format (llama.cpp's GGUFs carry one): `{query}` and `{document}` replaced
        self.rerank_template = _select_chat_template(self.config.get("chat_template"), name=RERANK_TEMPLATE)
        # When the config states add_bos/add_eos we apply them ourselves (and bypass the
        # tokenizer.json post-processor); otherwise the post-processor decides, as in transformers.
        self._explicit_specials = "add_bos_token" in self.config or "add_eos_token" in self.config

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (and eos ids from config.json /
        generation_config.json when present) from an HF model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"Tokenizer file not found: {tokenizer_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:
            raise ValueError(f"Cannot parse {tokenizer_file}: {error}") from error
        return_free_heap()
        config = _read_json(path / "tokenizer_config.json", required=True)
        extra_eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            model_config = _read_json(path / name, required=False) or {}
            extra_eos += _as_id_list(model_config.get("eos_token_id"))
        template_file = path / "chat_template.jinja"  # where newer transformers versions save it
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(backend, config=config, extra_eos_token_ids=extra_eos, chat_template=template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch gives encode's ids but runs without the GIL (encode holds it for the whole
        # call: seconds for a MB-sized prompt, during which a server's event loop would stall).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def rerank_prompts(self, queries: list, documents: list, pairs: list[tuple[int, int]]) -> list[list[int]] | None:
        """Each (query i, document j) pair read through the rerank template, as llama.cpp reads
        it; None without a template, or when an input is token ids (those pairs are concatenated)."""
        template = self.rerank_template
        if template is None or not all(isinstance(text, str) for text in (*queries, *documents)):
            return None

        def fill(query: str, document: str) -> str:  # in one pass: a query may hold "{document}"
            return re.sub(r"\{(query|document)\}", lambda m: query if m[1] == "query" else document, template)

        return [self.encode(fill(queries[i], documents[j])) for i, j in pairs]

    def cross_encoder_prompts(
        self,
        firsts: list,
        seconds: list,
        pairs: list[tuple[int, int]],
        *,
        token_ids: Callable[[list, bool], list[list[int]]],
    ) -> list[list[int]]:
        """Each (first i, second j) pair as one prompt of a cross-encoder: through the rerank
        template (rerank_prompts), else the first's tokens then the second's without special
        tokens (vLLM's). `token_ids(inputs, add_special_tokens)` tokenizes the caller's inputs."""
        prompts = self.rerank_prompts(firsts, seconds, pairs)
        if prompts is not None:
            return prompts
        first_ids, second_ids = token_ids(firsts, True), token_ids(seconds, False)
        return [first_ids[i] + second_ids[j] for i, j in pairs]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; BOS (and EOS) added when the config says so and add_special_tokens.

        Special-token text such as "<start_of_turn>" is always parsed as the special token. Encode a
        rendered chat template with add_special_tokens=False: templates write BOS themselves.
        """
        if not self._explicit_specials:
            return self._encode(text, add_special_tokens=add_special_tokens)
        ids = self._encode(text, add_special_tokens=False)
        if not add_special_tokens:
            return ids
        if self.config.get("add_bos_token") and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.config.get("add_eos_token") and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **template_vars: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's jinja chat template,
        or with `chat_template` when given. Extra keyword arguments become template variables."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("This tokenizer has no chat template (no chat_template in tokenizer_config.json)")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""} | template_vars
        return _compile_chat_template(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )


def check_chat_template(template: str) -> None:
    """A ValueError naming the problem where the jinja text does not compile."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        _compile_chat_template(template)
    except TemplateSyntaxError as err:
        raise ValueError(f"chat_template: not a valid jinja template (line {err.lineno}): {err.message}") from err


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks, helpers)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which templates don't expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive.

    Each `add` decodes a short window (the tokens since the last emission, plus the few before them
    for context) and returns the text that became final. Text ending in U+FFFD is held back: a
    character split over several byte-fallback tokens (an emoji is 4 `<0xNN>` tokens) only decodes
    once all of them are there. `flush` returns whatever is still held at the end of generation.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append ids; return the newly completed text ("" while a character is incomplete)."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self.ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        # Decoding the prefix together with the new ids keeps decoder context (e.g. a
        # SentencePiece leading-space strip applies to the window start in both decodes).
        new_text = window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """Emit the held-back text, broken characters included (generation has ended)."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self.ids[self._prefix_offset :])
        new_text = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += new_text
        return new_text
