"""Embeddings from the target: a prompt's final hidden states (after the model's last norm, the
LM head's input) pooled into one vector, through the model's own modules after pooling where its
directory has them (vLLM's `LLM.embed` and `/v1/embeddings`, llama.cpp's `--embeddings`).

The engine runs an embedding prompt as a prefill of its own (Engine.embed), in chunks of the
step's token budget; the kernels being batch-invariant, its vector is the same bits however it
was chunked and whatever ran beside it.  An encoder (bidirectional attention, EmbeddingGemma)
runs each prompt whole in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.models.config import ModelConfig
from quickdraft.models.sentence_transformers import EmbeddingHead, read_embedding_head

# LAST: the last token's state (vLLM's default for decoder-only models: the only one that saw the
# whole prompt); MEAN: the average over the prompt's tokens; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's pooling tasks (LLM.encode, /pooling): one vector per prompt (embed), its class
# probabilities (classify), or one of either per prompt token (token_embed, token_classify).
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass
class PoolingParams:
    """How one prompt becomes an embedding (vLLM's PoolingParams, with the pooler's type).

    pooling_type: LAST, MEAN or CLS; None: the model's own (a sentence-transformers directory's
    Pooling module, else LAST).
    normalize: scale the vector to unit L2 norm (cosine similarity is then a dot product).
    dimensions: the length asked for: the model's own, or one it was trained to be cut to
    ("matryoshka" embeddings: `matryoshka_dimensions` / `is_matryoshka` in config.json).
    truncate_prompt_tokens: keep only the prompt's last k tokens (None: the whole prompt).
    """

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True)
class Pooler:
    """A model's way from final hidden states to an embedding: its default pooling, the modules
    after pooling (a sentence-transformers directory's Dense layers), and the lengths it may be
    cut to."""

    pooling_type: str  # the model's default
    hidden_size: int
    head: EmbeddingHead | None = None
    # lengths besides the full one an embedding may be cut to; True: any (is_matryoshka)
    matryoshka_dimensions: tuple[int, ...] | bool = ()
    classifier: Classifier | None = None  # a *ForSequenceClassification model's score head

    @property
    def cross_encoder(self) -> bool:
        """Whether pairs are scored by the model reading them together (a classifier of one label:
        a reranker) rather than by the cosine of two embeddings."""
        return self.classifier is not None and self.classifier.num_labels == 1

    @property
    def output_size(self) -> int:
        return self.hidden_size if self.head is None else self.head.output_size(self.hidden_size)

    def check(self, params: PoolingParams) -> None:
        """ValueError naming `dimensions` when the model cannot give that length."""
        size, wanted = self.output_size, params.dimensions
        if wanted is None or wanted == size:
            return
        allowed = self.matryoshka_dimensions
        if allowed is True and wanted < size:
            return
        if isinstance(allowed, tuple) and wanted in allowed:
            return
        if not allowed:
            raise ValueError(
                f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened to "
                f"{wanted} (it was not trained for matryoshka embeddings)"
            )
        lengths = f"1..{size}" if allowed is True else ", ".join(str(n) for n in sorted({*allowed, size}))
        raise ValueError(f"dimensions: this model's embeddings can have {lengths} dimensions, not {wanted}")

    def __call__(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:  # [T, D] -> [D'] float32
        pooling_type = params.pooling_type or self.pooling_type
        if pooling_type == "LAST":
            vector = hidden[-1].float()
        elif pooling_type == "CLS":
            vector = hidden[0].float()
        else:
            vector = hidden.float().mean(dim=0)
        return self._project(vector, params)

    def _project(self, vectors: torch.Tensor, params: PoolingParams) -> torch.Tensor:  # [..., D] -> [..., D']
        """Pooled states through the modules after pooling, cut to `dimensions`, normalized."""
        if self.head is not None:
            vectors = self.head.project(vectors)
        if params.dimensions is not None:
            vectors = vectors[..., : params.dimensions]
        if params.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
        return vectors

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, D] final states -> [num_labels] float32
        """The classifier's probabilities from the last token's state (as transformers' decoder
        classifiers read it): a sigmoid for one label, a softmax over several."""
        return self._probabilities(hidden[-1:])[0]

    def _probabilities(self, states: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, num_labels] float32
        assert self.classifier is not None  # check_task refuses a model without one, by name
        logits = self.classifier.logits(states.float())
        return torch.sigmoid(logits) if self.classifier.num_labels == 1 else torch.softmax(logits, dim=-1)

    @property
    def default_task(self) -> str:
        """What LLM.encode and /pooling compute when no task is named: a classifier's
        probabilities, else an embedding."""
        return "classify" if self.classifier is not None else "embed"

    def check_task(self, task: str, *, field: str = "pooling_task") -> None:
        """ValueError naming `task` (given as `field`) when it is unknown or this model cannot run it."""
        if task not in POOLING_TASKS:
            raise ValueError(f"{field} must be one of {list(POOLING_TASKS)}, got {task!r}")
        if task.endswith("classify") and self.classifier is None:
            raise ValueError(
                f"{field} {task!r} needs a classification head (a *ForSequenceClassification checkpoint); "
                "this model has none: use 'embed' or 'token_embed'"
            )

    def pool(self, hidden: torch.Tensor, params: PoolingParams, *, task: str) -> torch.Tensor:
        """[T, D] final states -> `task`'s result, float32: embed [D'], classify [num_labels],
        token_embed [T, D'] (each token's state through the modules after pooling, cut to
        `dimensions` and normalized as an embedding is), token_classify [T, num_labels]."""
        if task == "embed":
            return self(hidden, params)
        if task == "classify":
            return self.classify(hidden)
        if task == "token_classify":
            return self._probabilities(hidden)
        return self._project(hidden.float(), params)

    @classmethod
    def of_model(cls, model_dir: Path, *, config: ModelConfig, hf_config: dict) -> Pooler:
        """The pooler a model directory declares (modules.json; config.json's matryoshka keys; a
        classifier's `score` head)."""
        head = read_embedding_head(model_dir)
        dims = hf_config.get("matryoshka_dimensions")
        matryoshka: tuple[int, ...] | bool = (
            tuple(int(n) for n in dims) if isinstance(dims, list) else bool(hf_config.get("is_matryoshka"))
        )
        pooling_type = head.pooling_type if head is not None and head.pooling_type else "LAST"
        return cls(
            pooling_type=pooling_type,
            hidden_size=config.hidden_size,
            head=head,
            matryoshka_dimensions=matryoshka,
            classifier=Classifier.of_model(model_dir, config) if config.num_labels else None,
        )


@dataclass(frozen=True)
class Classifier:
    """A sequence classifier's head: logits = weight @ state (+ bias) over `labels`."""

    weight: torch.Tensor  # [num_labels, D] float32
    bias: torch.Tensor | None  # [num_labels] float32
    labels: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def logits(self, state: torch.Tensor) -> torch.Tensor:  # [D] -> [num_labels]
        return torch.nn.functional.linear(state, self.weight, self.bias)

    @classmethod
    def of_model(cls, model_dir: Path, config: ModelConfig) -> Classifier:
        from quickdraft.models.loader import read_hf_tensors

        tensors = read_hf_tensors(model_dir, names={"score.weight", "score.bias"})
        weight = tensors.get("score.weight")
        expected = (config.num_labels, config.hidden_size)
        if weight is None or tuple(weight.shape) != expected:
            found = "none" if weight is None else tuple(weight.shape)
            raise ValueError(f"{model_dir}: a classifier needs score.weight of shape {expected}, found {found}")
        bias = tensors.get("score.bias")
        return cls(weight=weight.float(), bias=None if bias is None else bias.float(), labels=config.labels)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's output of LLM.embed)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    """What a pooling task gives one prompt (vLLM's): embed [D], classify [num_labels],
    token_embed [T, D], token_classify [T, num_labels] (T: the prompt tokens run)."""

    data: torch.Tensor  # float32


@dataclass
class PoolingRequestOutput:
    """One prompt's result of LLM.encode (vLLM's PoolingRequestOutput)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's output of LLM.score): the cosine similarity of the two texts'
    embeddings, or a reranker's score of the pair read as one prompt."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the first text's tokens, then the second's
    finished: bool = True


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Which texts a score call pairs (vLLM's rule): one first text with every second one (1:N),
    or the i-th with the i-th (N:N); ValueError otherwise."""
    if num_first < 1 or num_second < 1:
        raise ValueError("scoring needs at least one text on each side")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first == num_second:
        return [(i, i) for i in range(num_first)]
    raise ValueError(f"scoring pairs one text with N, or N with N: got {num_first} and {num_second}")


def cosine_similarity(first: torch.Tensor, second: torch.Tensor) -> float:  # [D], [D]
    return float(torch.nn.functional.cosine_similarity(first.double(), second.double(), dim=0))


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One prompt's class probabilities (vLLM's output of LLM.classify)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
