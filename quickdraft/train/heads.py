"""`quickdraft train-head`: build data from the target, train a draft head, report acceptance.

Stages, each resumable from the output folder:

1. data: the target answers generated prompts; features are recorded while it does
   (``data/shard-*.safetensors``; existing shards are kept);
2. draft vocabulary: the most frequent answer tokens (``draft_vocab_size`` of them);
3. training: an eagle3 head is unrolled over ``train_depths`` draft depths per anchor
   (training-time test); medusa heads predict depth k from the last layer; self and draft heads the
   next token; cross-entropy on the target's tokens (an eagle3 head with a copy path,
   ``copy_dim`` > 0: -log of its vocabulary/copy mixture), AdamW with warm-up and
   cosine decay; ``checkpoint.pt`` after every epoch and every ``checkpoint_every`` steps;
4. validation on held-out sequences: per-depth top-1 accuracy and the chain acceptance
   length a greedy chain of ``val_depths`` draft tokens would reach (teacher forcing with
   the target's own tokens is exact for that: a chain continues only while it is right);
5. the head (bf16 safetensors) and ``manifest.json`` (command, data, seed, figures).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.heads import inherited_drafting
from quickdraft.models.heads import CopyPath, EagleHead, HeadConfig
from quickdraft.models.medusa import LayerSkipHead, MedusaConfig, MedusaHeads
from quickdraft.models.mtp import MtpHead
from quickdraft.models.quantized import matrix_weights
from quickdraft.train.data import MIXES_ON_TRANSCRIPTS, PROMPT_MIXES, DataShard, Sequence, build_prompts, generate_shard
from quickdraft.train.draft_model import DraftLM

METHODS = ("eagle3", "medusa", "self", "draft", "mtp")
RESUMABLE_HEADS = {"eagle3": EagleHead, "medusa": MedusaHeads, "self": LayerSkipHead}  # init_head can start them


@dataclass
class TrainHeadConfig:
    out: Path
    method: str = "eagle3"
    target: str | None = None
    dtype: str = "float32"  # "auto": the target as stored (a GGUF's quantized weights; faster data)
    device: str = "cpu"
    num_prompts: int = 480
    prompt_mix: str = "tasks"  # see quickdraft.train.data.build_prompts
    extra_data: tuple[Path, ...] = ()  # data folders of earlier runs whose shards are trained on too
    # data folders the head is validated on besides its held-out split, never trained on (answers to
    # benchmark-like prompts: benchmarks/specbench_val_data.py); with init_head, epochs 0 and
    # num_prompts 0 the run only validates that head on them
    val_data: tuple[Path, ...] = ()
    init_head: Path | None = None  # a trained head to start from (fine-tuning; its draft vocabulary is kept)
    copy_dim: int = 0  # eagle3, self: width of a learned copy path (0: none); eagle3 with init_head: a fresh one
    shard_prompts: int = 32
    max_new_tokens: int = 256
    sampled_fraction: float = 0.25  # share of answers sampled (temperature 0.7) instead of greedy
    feature_layers: tuple[int, ...] | None = None  # default: low, middle and last layer
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None  # default: the target's
    train_depths: int = 3  # eagle3: draft depths unrolled in training
    medusa_heads: int = 4  # medusa: heads (draft depths)
    exit_layer: int | None = None  # self: target layers the drafter runs (default: half of them, plus one)
    draft_layers: int = 2  # draft: decoder layers of the distilled draft model
    val_depths: int = 5
    epochs: int = 2  # 0: build OUT/data only (to train on later with extra_data), no head
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    sequences_per_step: int = 4
    max_seq_len: int = 1024
    val_sequences: int = 24
    checkpoint_every: int = 50
    seed: int = 0
    command: str | None = None

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.extra_data = tuple(Path(d) for d in self.extra_data)
        self.val_data = tuple(Path(d) for d in self.val_data)
        if self.prompt_mix in MIXES_ON_TRANSCRIPTS and self.num_prompts and not self.extra_data:
            raise ValueError(f"prompt_mix {self.prompt_mix!r} builds on earlier answers: give extra_data")
        if self.init_head is not None:
            self.init_head = Path(self.init_head)
            if self.method not in RESUMABLE_HEADS:
                raise ValueError(
                    f"init_head: a {self.method} head cannot be started from a trained one; "
                    f"these can: {list(RESUMABLE_HEADS)}"
                )
            if not self.init_head.is_dir():
                raise ValueError(f"init_head {str(self.init_head)!r} is not a head folder")
        for name, folders in (("extra_data", self.extra_data), ("val_data", self.val_data)):
            for folder in folders:
                if not shard_paths(folder):
                    raise ValueError(f"{name} folder {str(folder)!r} holds no shard-*.safetensors files")
        if self.prompt_mix not in PROMPT_MIXES:
            raise ValueError(f"unknown prompt_mix {self.prompt_mix!r}; choose one of {list(PROMPT_MIXES)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown head method {self.method!r}; trainable here: {list(METHODS)}")
        if not isinstance(self.num_prompts, int) or self.num_prompts < (
            0 if self.extra_data or self.validate_only else 1
        ):
            raise ValueError(
                f"num_prompts must be a positive integer (0 only with extra_data, or to validate an init_head "
                f"on val_data), got {self.num_prompts!r}"
            )
        for name in (
            "shard_prompts",
            "medusa_heads",
            "draft_layers",
            "max_new_tokens",
            "draft_vocab_size",
            "train_depths",
            "val_depths",
            "sequences_per_step",
            "max_seq_len",
            "checkpoint_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer (0: build the data only), got {self.epochs!r}")
        if self.epochs == 0 and self.num_prompts == 0 and not self.validate_only:
            raise ValueError(
                "epochs 0 builds data only, and num_prompts 0 asks for none: nothing to do "
                "(to validate a trained head, give init_head and val_data)"
            )
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}")
        if self.exit_layer is not None and (not isinstance(self.exit_layer, int) or self.exit_layer < 1):
            raise ValueError(f"exit_layer must be a positive integer, got {self.exit_layer!r}")
        if not isinstance(self.val_sequences, int) or self.val_sequences < 1:
            raise ValueError(f"val_sequences must be a positive integer, got {self.val_sequences!r}")
        if not isinstance(self.copy_dim, int) or isinstance(self.copy_dim, bool) or self.copy_dim < 0:
            raise ValueError(f"copy_dim must be a non-negative integer, got {self.copy_dim!r}")
        if self.copy_dim and self.method not in ("eagle3", "self"):
            raise ValueError(f"copy_dim: only eagle3 and self heads have a copy path, not {self.method}")
        if self.copy_dim and self.init_head is not None and self.method != "eagle3":
            raise ValueError(f"copy_dim with init_head: only an eagle3 head gains a fresh copy path, not {self.method}")

    @property
    def head_max_len(self) -> int:
        """Positions a head is built or loaded for: the longest sequence plus its validation depths."""
        return self.max_seq_len + self.val_depths + 2

    @property
    def validate_only(self) -> bool:
        """No data to build and nothing to train: the init head is validated on val_data."""
        return self.epochs == 0 and self.num_prompts == 0 and self.init_head is not None and bool(self.val_data)

    @property
    def depths(self) -> int:
        """Draft depths trained (eagle3: unrolled; medusa: one per head)."""
        return {"medusa": self.medusa_heads, "self": 1, "draft": 1}.get(self.method, self.train_depths)

    @property
    def validation_depths(self) -> int:
        """Draft depths validated: medusa has one per head, the others draft val_depths deep."""
        return self.medusa_heads if self.method == "medusa" else self.val_depths


@dataclass
class TrainReport:
    train_sequences: int = 0
    train_answer_tokens: int = 0
    draft_vocab_coverage: float = 0.0
    steps: int = 0
    seconds: dict = field(default_factory=dict)
    final_train_loss: float | None = None
    val_accuracy_by_depth: list[float] = field(default_factory=list)
    val_chain_acceptance_length: float | None = None
    # the same on the val_data folders' sequences (empty / None without val_data)
    val_data_accuracy_by_depth: list[float] = field(default_factory=list)
    val_data_chain_acceptance_length: float | None = None
    parameters: int = 0
    head_bytes: int = 0
    draft_token_cost: float | None = None  # head matmul weights per draft token / target's per token


def train_head(config: TrainHeadConfig, *, progress: bool = True) -> TrainReport:
    torch.manual_seed(config.seed)
    config.out.mkdir(parents=True, exist_ok=True)
    report = TrainReport()
    start = time.perf_counter()
    llm = _load_target(config)
    target = llm.engine.model
    layers = config.feature_layers or default_feature_layers(target.config.num_layers)
    if config.validate_only:
        start = time.perf_counter()  # the head's validation alone, as in a training run's report
        head = load_trained_head(config.method, config.init_head, max_len=config.head_max_len)
        head.attach_target(target)
        _validate_on_val_data(config, report, head, layers=layers, target=target)
        report.seconds["validate"] = time.perf_counter() - start
        return report
    # The earlier data: trained on, or (articles) the transcripts new prompts build on; a
    # data-only run of another mix needs none of it.
    needs_extra = config.epochs > 0 or config.prompt_mix in MIXES_ON_TRANSCRIPTS
    extra = load_shards(config.extra_data if needs_extra else ())
    transcripts = (
        [llm.tokenizer.decode(s.token_ids) for shard in extra for s in shard.sequences]
        if config.prompt_mix in MIXES_ON_TRANSCRIPTS
        else []
    )
    built = _build_data(config, llm, layers, transcripts=transcripts, progress=progress)
    report.seconds["data"] = time.perf_counter() - start
    if config.epochs == 0:  # data only: report what this run built, not the extra data it built on
        new = [s for shard in built for s in shard.sequences]
        report.train_sequences = len(new)
        report.train_answer_tokens = sum(s.num_answer_tokens for s in new)
        return report
    sequences = [s for shard in built + extra for s in shard.sequences]
    random.Random(config.seed).shuffle(sequences)
    if len(sequences) <= config.val_sequences:
        raise ValueError(
            f"{len(sequences)} sequences of data: fewer than val_sequences ({config.val_sequences}) "
            f"plus one to train on"
        )
    val, train = sequences[: config.val_sequences], sequences[config.val_sequences :]
    max_len = config.head_max_len
    if config.init_head is None:
        d2t, coverage = draft_vocabulary(train, config.draft_vocab_size, vocab_size=target.config.vocab_size)
        head = new_head(
            target,
            method=config.method,
            layers=layers,
            draft_vocab_size=len(d2t),
            intermediate_size=config.intermediate_size,
            medusa_heads=config.medusa_heads,
            exit_layer=config.exit_layer,
            draft_layers=config.draft_layers,
            max_len=max_len,
            copy_dim=config.copy_dim,
        )
        head.set_draft_vocab(d2t)
    else:
        head = load_trained_head(config.method, config.init_head, max_len=max_len, copy_dim=config.copy_dim)
        d2t, coverage = head.d2t.clone(), vocabulary_coverage(train, head.d2t)
    report.train_sequences, report.draft_vocab_coverage = len(train), coverage
    report.train_answer_tokens = sum(s.num_answer_tokens for s in train)
    head.attach_target(target)
    target_dir = llm.engine.model_dir
    del llm
    t2d = target_to_draft(d2t, vocab_size=target.config.vocab_size)
    columns = feature_columns(
        data_layers=layers, head_layers=head_feature_layers(head), hidden_size=target.config.hidden_size
    )
    train = [s.with_features(s.features[:, columns]) for s in train] if columns is not None else train
    val = [s.with_features(s.features[:, columns]) for s in val] if columns is not None else val
    started = time.perf_counter()
    report.final_train_loss, report.steps = _train(config, head, train, t2d, progress=progress)
    report.seconds["train"] = time.perf_counter() - started
    started = time.perf_counter()
    report.val_accuracy_by_depth, report.val_chain_acceptance_length = validate(
        head, val, t2d, depths=config.validation_depths, max_seq_len=config.max_seq_len
    )
    _validate_on_val_data(config, report, head, layers=layers, target=target)
    report.seconds["validate"] = time.perf_counter() - started
    report.parameters = sum(p.numel() for p in head.parameters())
    report.draft_token_cost = draft_token_cost(head, target)
    head_dir = config.out / "head"
    if isinstance(head, DraftLM):
        head.save(head_dir, target_dir=target_dir)
    else:
        head.save(head_dir)
    report.head_bytes = sum(f.stat().st_size for f in head_dir.iterdir())
    _write_manifest(config, report, head_feature_layers(head))
    return report


def _validate_on_val_data(config: TrainHeadConfig, report: TrainReport, head, *, layers, target) -> None:
    """report.val_data_*: `head` validated on the val_data folders' sequences (recorded at the
    run's feature layers, like extra_data), as on the held-out split."""
    if not config.val_data:
        return
    sequences = [s for shard in load_shards(config.val_data) for s in shard.sequences]
    columns = feature_columns(
        data_layers=layers, head_layers=head_feature_layers(head), hidden_size=target.config.hidden_size
    )
    if columns is not None:
        sequences = [s.with_features(s.features[:, columns]) for s in sequences]
    t2d = target_to_draft(head.d2t, vocab_size=target.config.vocab_size)
    report.val_data_accuracy_by_depth, report.val_data_chain_acceptance_length = validate(
        head, sequences, t2d, depths=config.validation_depths, max_seq_len=config.max_seq_len
    )


def shard_paths(folder: Path) -> list[Path]:
    """A data folder's shards, in order."""
    return sorted(folder.glob("shard-*.safetensors"))


def load_shards(folders) -> list[DataShard]:
    """Every shard of the data folders, folder by folder."""
    return [DataShard.load(path) for folder in folders for path in shard_paths(folder)]


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high features: an early layer, the middle one and the last."""
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


def new_head(
    target,
    *,
    method: str = "eagle3",
    layers,
    draft_vocab_size: int,
    intermediate_size: int | None,
    max_len: int,
    medusa_heads: int = 4,
    exit_layer: int | None = None,
    draft_layers: int = 2,
    copy_dim: int = 0,
):
    c = target.config
    if method == "mtp":
        head = MtpHead(c, draft_vocab_size=draft_vocab_size, max_len=max_len)
        head.initialise_from(target)
        return head
    if method == "draft":
        return DraftLM(c, num_layers=draft_layers, draft_vocab_size=draft_vocab_size, max_len=max_len)
    if method == "self":
        exit_layer = exit_layer or c.num_layers // 2 + 1
        if not 1 <= exit_layer < c.num_layers:
            raise ValueError(f"exit_layer must be in 1..{c.num_layers - 1} for a {c.num_layers}-layer target")
        return LayerSkipHead(
            MedusaConfig(
                hidden_size=c.hidden_size,
                num_heads=1,
                draft_vocab_size=draft_vocab_size,
                feature_layer=exit_layer - 1,
                copy_dim=copy_dim,
            )
        )
    if method == "medusa":
        return MedusaHeads(
            MedusaConfig(
                hidden_size=c.hidden_size,
                num_heads=medusa_heads,
                draft_vocab_size=draft_vocab_size,
                feature_layer=c.num_layers - 1,
            )
        )
    config = HeadConfig(
        hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=intermediate_size or c.intermediate_size,
        feature_layers=tuple(layers),
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        activation=c.activation,
        copy_dim=copy_dim,
    )
    return EagleHead(config, max_len=max_len)


def load_trained_head(method: str, directory: Path, *, max_len: int, copy_dim: int = 0):
    """The head in `directory`, to fine-tune; `copy_dim` > 0 gives an eagle3 head that has no copy
    path a fresh one (a head that has one keeps it: leave copy_dim at 0)."""
    cls = RESUMABLE_HEADS[method]
    options = {"max_len": max_len} if cls is EagleHead else {}
    head = cls.load(directory, dtype=torch.float32, **options)
    if copy_dim:
        if head.config.copy_dim:
            raise ValueError(
                f"init_head {str(directory)!r} already has a copy path (copy_dim "
                f"{head.config.copy_dim}); leave copy_dim at 0 to go on training it"
            )
        head = head.with_fresh_copy_path(copy_dim)
    return head


def has_copy_path(head) -> bool:
    return isinstance(head, CopyPath) and head.copy_dim > 0


def vocabulary_coverage(sequences: list[Sequence], d2t: torch.Tensor) -> float:
    """Share of the answer tokens of `sequences` that the draft vocabulary `d2t` holds."""
    vocabulary = set(d2t.tolist())
    answers = [t for s in sequences for t in s.token_ids[s.num_prompt_tokens :]]
    return sum(t in vocabulary for t in answers) / len(answers) if answers else 0.0


def draft_vocabulary(sequences: list[Sequence], size: int, *, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (draft id order = frequency order) and the share of
    answer tokens they cover."""
    counts = Counter()
    for s in sequences:
        counts.update(s.token_ids[s.num_prompt_tokens :])
    ranked = [token for token, _ in counts.most_common(size)]
    if len(ranked) < size:  # pad with the lowest unused ids so the table has its full size
        used = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in used][: size - len(ranked)]
    total = sum(counts.values())
    covered = sum(counts[t] for t in ranked)
    return torch.tensor(ranked, dtype=torch.long), covered / total if total else 0.0


def target_to_draft(d2t: torch.Tensor, *, vocab_size: int) -> torch.Tensor:  # [V]: draft id or -100
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.shape[0])
    return t2d


def head_feature_layers(head) -> tuple[int, ...]:
    return tuple(head.feature_layers)


def feature_columns(*, data_layers, head_layers, hidden_size: int) -> torch.Tensor | None:
    """Columns of the recorded features [n, len(data_layers) * D] a head reads (None: all)."""
    data_layers, head_layers = tuple(data_layers), tuple(head_layers)
    if head_layers == data_layers:
        return None
    if not head_layers:
        return torch.zeros(0, dtype=torch.long)  # no features: keep none in memory
    missing = [layer for layer in head_layers if layer not in data_layers]
    if missing:
        raise ValueError(f"the head reads target layers {missing} that the data does not hold ({list(data_layers)})")
    return torch.cat([torch.arange(hidden_size) + data_layers.index(layer) * hidden_size for layer in head_layers])


def draft_token_cost(head, target) -> float:
    """Matrix weights read per draft token (the head's share + draft LM rows) over the target's."""
    return head.weights_per_draft_token() / matrix_weights(target)


def _load_target(config: TrainHeadConfig):
    from quickdraft.llm import LLM

    return LLM(
        config.target,
        dtype=config.dtype,
        device=config.device,
        max_num_seqs=16,
        max_model_len=config.max_seq_len,
        seed=config.seed,
        enable_prefix_caching=False,  # the recorder needs the features of every token
    )


def _build_data(config: TrainHeadConfig, llm, layers, *, transcripts: list[str], progress: bool) -> list[DataShard]:
    from tqdm import tqdm

    data_dir = config.out / "data"
    data_dir.mkdir(exist_ok=True)
    prompts = _fitting_prompts(config, llm.tokenizer, transcripts=transcripts)
    num_shards = math.ceil(config.num_prompts / config.shard_prompts)
    shards = []
    bar = tqdm(total=config.num_prompts, desc="target answers (data)", unit="prompt", disable=not progress)
    for index in range(num_shards):
        path = data_dir / f"shard-{index:04d}.safetensors"
        chunk = prompts[index * config.shard_prompts : (index + 1) * config.shard_prompts]
        if path.is_file():
            shard = DataShard.load(path)
        else:
            sampled = random.Random(config.seed + index).random() < config.sampled_fraction
            shard = generate_shard(
                llm,
                chunk,
                feature_layers=layers,
                max_new_tokens=config.max_new_tokens,
                temperature=0.7 if sampled else 0.0,
                seed=config.seed + index * 1000,
            )
            shard.save(path)
        shards.append(shard)
        bar.update(len(chunk))
    bar.close()
    return shards


def _fitting_prompts(config: TrainHeadConfig, tokenizer, *, transcripts: list[str]) -> list[str]:
    """The first num_prompts generated prompts whose answer still fits max_seq_len."""
    if not config.num_prompts:
        return []
    limit = config.max_seq_len - config.max_new_tokens
    candidates = build_prompts(4 * config.num_prompts, seed=config.seed, mix=config.prompt_mix, transcripts=transcripts)
    fitting = [p for p in candidates if len(tokenizer.encode(p)) <= limit][: config.num_prompts]
    if len(fitting) < config.num_prompts:
        raise ValueError(
            f"only {len(fitting)} prompts fit max_seq_len {config.max_seq_len} with "
            f"{config.max_new_tokens} new tokens; raise max_seq_len or lower max_new_tokens"
        )
    return fitting


def _sequence_loss(head: EagleHead, seq: Sequence, t2d: torch.Tensor, *, depths: int, max_seq_len: int):
    tokens = torch.tensor(seq.token_ids[:max_seq_len])
    # Anchors before this one predict only prompt tokens at every depth: no logits for them.
    first_anchor = max(0, min(seq.num_prompt_tokens - depths - 1, len(tokens) - 2))
    anchors = torch.arange(first_anchor, len(tokens) - 1)
    if has_copy_path(head):
        return _copy_sequence_loss(head, tokens, seq, first_anchor=first_anchor, depths=depths)
    logits = head.training_logits(
        tokens, seq.features[: len(tokens) - 1].float(), depths=depths, first_anchor=first_anchor
    )
    total, count = 0.0, 0
    for depth, depth_logits in enumerate(logits, start=1):
        labels, inside = depth_labels(tokens, anchors, depth=depth, t2d=t2d, first_target=seq.num_prompt_tokens)
        if not inside.any():
            continue
        weight = 0.8 ** (depth - 1)
        loss = F.cross_entropy(depth_logits[inside], labels[inside], ignore_index=-100, reduction="sum")
        total = total + weight * loss
        count += int((labels >= 0).sum())
    return total, count


def _copy_sequence_loss(head: EagleHead, tokens: torch.Tensor, seq: Sequence, *, first_anchor: int, depths: int):
    """_sequence_loss of a head with a copy path: -log of the mixture's probability of the true
    token, which now also counts tokens outside the draft vocabulary that the context holds."""
    mixtures = head.unrolled_mixtures(
        tokens, seq.features[: len(tokens) - 1].float(), depths=depths, first_anchor=first_anchor
    )
    anchors = torch.arange(first_anchor, len(tokens) - 1)
    total, count = 0.0, 0
    for depth, mixture in enumerate(mixtures, start=1):
        targets, inside = depth_targets(tokens, anchors, depth=depth, first_target=seq.num_prompt_tokens)
        log_probs, possible = mixture.log_prob(targets)
        counted = inside & possible
        if not counted.any():
            continue
        total = total - 0.8 ** (depth - 1) * log_probs[counted].sum()
        count += int(counted.sum())
    return total, count


def depth_targets(
    tokens: torch.Tensor, anchors: torch.Tensor, *, depth: int, first_target: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids of depth `depth` at `anchors` (0 where there is none) and the mask of anchors
    whose target exists and is at or past `first_target` (see depth_labels)."""
    target_index = anchors + depth + 1
    inside = (target_index < len(tokens)) & (target_index >= first_target)
    targets = torch.zeros(anchors.shape, dtype=torch.long)
    targets[inside] = tokens[target_index[inside]]
    return targets, inside


def depth_labels(
    tokens: torch.Tensor, anchors: torch.Tensor, *, depth: int, t2d: torch.Tensor, first_target: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-vocabulary labels of depth `depth` at `anchors` (depth k at anchor j predicts token
    j + k + 1) and the mask of anchors whose target exists and is at or past `first_target`.
    Labels are -100 outside the mask and for tokens outside the draft vocabulary."""
    targets, inside = depth_targets(tokens, anchors, depth=depth, first_target=first_target)
    labels = torch.full(anchors.shape, -100, dtype=torch.long)
    labels[inside] = t2d[targets[inside]]
    return labels, inside


def _train(
    config: TrainHeadConfig, head, train: list[Sequence], t2d: torch.Tensor, *, progress: bool
) -> tuple[float | None, int]:
    from tqdm import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train) / config.sequences_per_step)
    total_steps = steps_per_epoch * config.epochs
    checkpoint = config.out / "checkpoint.pt"
    step = 0
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    rng = random.Random(config.seed)
    orders = []
    for _ in range(config.epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        orders.append(order)
    head.train()
    bar = tqdm(total=total_steps, initial=step, desc="training head", unit="step", disable=not progress)
    last_loss = None
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        batch = orders[epoch][within * config.sequences_per_step : (within + 1) * config.sequences_per_step]
        lr = (
            config.learning_rate
            * min(1.0, (step + 1) / config.warmup_steps)
            * 0.5
            * (1 + math.cos(math.pi * step / total_steps))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0
        for index in batch:
            loss, count = _sequence_loss(head, train[index], t2d, depths=config.depths, max_seq_len=config.max_seq_len)
            if count:
                loss.backward()
                loss_sum += float(loss.detach())
                tokens += count
        for p in params:
            if p.grad is not None:
                p.grad /= max(1, tokens)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        last_loss = loss_sum / max(1, tokens)
        bar.set_postfix(loss=f"{last_loss:.3f}")
        bar.update(1)
        if step % config.checkpoint_every == 0 or step % steps_per_epoch == 0:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint)
    bar.close()
    head.eval()
    return last_loss, step


@torch.no_grad()
def validate(
    head, sequences: list[Sequence], t2d: torch.Tensor, *, depths: int, max_seq_len: int
) -> tuple[list[float], float]:
    """Per-depth top-1 accuracy over answer positions, and the acceptance length a greedy chain
    of `depths` draft tokens reaches when it decodes the answers step by step (a head with a copy
    path: top-1 of its vocabulary/copy mixture over target ids).

    Teacher forcing with the target's own tokens is exact for a greedy chain (a chain goes on
    only while it is right).  The acceptance length is simulated per step, as decoding
    counts it: an easy stretch is crossed in few steps, so it weighs less than a per-position
    average would make it (which overstates what decoding gets).
    """
    correct = [0] * depths
    total = [0] * depths
    committed = steps = 0
    for seq in sequences:
        tokens = torch.tensor(seq.token_ids[:max_seq_len])
        n = len(tokens) - 1
        first = max(0, min(seq.num_prompt_tokens - 1, n - 1))  # anchor whose root is the first answer token
        hits = torch.zeros(n - first, depths, dtype=torch.bool)
        for depth, depth_hits, inside in _top1_hits(
            head, tokens, seq.features[:n].float(), t2d, depths=depths, first_anchor=first
        ):
            hits[:, depth - 1] = depth_hits
            correct[depth - 1] += int(hits[inside, depth - 1].sum())
            total[depth - 1] += int(inside.sum())
        anchor = 0  # decode the answer: each step commits the accepted run plus one token
        while first + anchor + depths + 1 < len(tokens):
            run = 0
            while run < depths and hits[anchor, run]:
                run += 1
            committed += run + 1
            steps += 1
            anchor += run + 1
    accuracy = [c / t if t else 0.0 for c, t in zip(correct, total)]
    return accuracy, committed / steps if steps else 0.0


def _top1_hits(
    head, tokens: torch.Tensor, features: torch.Tensor, t2d: torch.Tensor, *, depths: int, first_anchor: int
):
    """Per depth: (depth, whether the head's most likely token is the true one [m], which rows
    have a true token [m]), at anchors first_anchor..T-2.  A head with a copy path is judged by
    its mixture over target ids, the others by their draft logits."""
    anchors = torch.arange(first_anchor, len(tokens) - 1)
    if has_copy_path(head):
        mixtures = head.unrolled_mixtures(tokens, features, depths=depths, first_anchor=first_anchor)
        for depth, mixture in enumerate(mixtures, start=1):
            targets, inside = depth_targets(tokens, anchors, depth=depth, first_target=0)
            yield depth, (mixture.top_k(1)[0][:, 0] == targets) & inside, inside
        return
    logits = head.training_logits(tokens, features, depths=depths, first_anchor=first_anchor)
    for depth, depth_logits in enumerate(logits, start=1):
        labels, inside = depth_labels(tokens, anchors, depth=depth, t2d=t2d, first_target=0)
        yield depth, (depth_logits.argmax(-1) == labels) & inside, inside


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _write_manifest(config: TrainHeadConfig, report: TrainReport, layers) -> None:
    options = {k: _jsonable(v) for k, v in asdict(config).items()}
    manifest = dict(
        method=config.method,
        target=config.target or "embedded Gemma 3 270M (GGUF Q4_K_M)",
        command=config.command,
        feature_layers=list(layers),
        options=options,
        data=(
            f"target's own answers (greedy, and temperature 0.7 for a share of shards) to prompts of the "
            f"{config.prompt_mix!r} mix (quickdraft.train.data.build_prompts: templates over the Python "
            f"documentation, the system's German gettext catalogues, word lists), plus the shards of "
            f"{[str(d) for d in config.extra_data]}; no Spec-Bench questions"
        ),
        report=asdict(report),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    drafting, source = inherited_drafting(config.method, init_head=config.init_head, depths=config.depths)
    if drafting:  # what a config that leaves them unset drafts with (quickdraft/heads drafting_options)
        manifest.update(drafting=drafting, drafting_measured=source)
    (config.out / "head" / "manifest.json").write_text(json.dumps(manifest, indent=1))
