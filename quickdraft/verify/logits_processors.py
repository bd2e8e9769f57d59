"""Per-request logits processors (vLLM's ``SamplingParams.logits_processors``), exact under
speculation.

A processor is a callable ``fn(output_token_ids, logits) -> logits`` or
``fn(prompt_token_ids, output_token_ids, logits) -> logits`` over one row of the target's
logits (``[V]``).  The engine calls it on every row it verifies, with that row's own history:
the committed output plus the drafted tokens on the node's path.  So a node deep in a tree sees
the output it would have had if decoded alone, and the distribution every draft is checked
against is the processed one; the output equals plain decoding with the same processors.

The price of that: a processor is called once per verified row, for branches that are then
rejected, rows out of order, and again for a request recomputed after preemption.  It must be a
function of its arguments (vLLM's contract too: its engines call one processor for several
sequences).  vLLM's current engine refuses custom logits processors when speculative decoding
is on; here they compose with every drafter.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

LogitsProcessor = Callable[..., torch.Tensor]


class LogitsProcessorError(ValueError):
    """A request's logits processor raised, or returned something other than a row of logits.
    The request fails with this message; requests beside it in the batch are not affected."""

    param = "logits_processors"


def processor_arity(processor: object, *, index: int) -> int:
    """2 for ``fn(output_token_ids, logits)``, 3 for ``fn(prompt_token_ids, output_token_ids,
    logits)``; a ValueError naming logits_processors[index] otherwise."""
    if not callable(processor):
        raise ValueError(f"logits_processors[{index}] must be callable, got {processor!r}")
    try:
        parameters = list(inspect.signature(processor).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return 2
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    variadic = any(p.kind == p.VAR_POSITIONAL for p in parameters)

    def takes(count: int) -> bool:
        return required <= count and (count <= len(positional) or variadic)

    # vLLM's rule: three declared parameters mean the form with the prompt
    for count in (3, 2) if len(positional) >= 3 else (2, 3):
        if takes(count):
            return count
    raise ValueError(
        f"logits_processors[{index}] ({processor_name(processor)}) must take (output_token_ids, logits) "
        f"or (prompt_token_ids, output_token_ids, logits), got the parameters {[p.name for p in parameters]}"
    )


def processor_name(processor: object) -> str:
    name = getattr(processor, "__qualname__", None) or type(processor).__qualname__
    module = getattr(processor, "__module__", None) or type(processor).__module__
    return f"{module}.{name}" if module else str(name)


def apply_logits_processors(
    row: torch.Tensor,  # [V] one row of logits (the grammar's mask applied, if any)
    processors: Sequence[LogitsProcessor],
    *,
    arities: Sequence[int],  # per processor, processor_arity's
    prompt_token_ids: Sequence[int],  # not copied: a tuple, or a list the processors only read
    output_token_ids: list[int],  # committed output + the drafted tokens on the row's path (the row's own)
) -> torch.Tensor:  # [V], same dtype and device
    """The row after each processor in turn; LogitsProcessorError naming the processor when one
    raises or returns no usable row (wrong shape, NaN, +inf, or no finite logit left)."""
    vocab = row.shape[0]
    for index, (processor, arity) in enumerate(zip(processors, arities)):
        name = f"logits_processors[{index}] ({processor_name(processor)})"
        try:
            if arity == 3:
                result = processor(prompt_token_ids, output_token_ids, row)
            else:
                result = processor(output_token_ids, row)
        except Exception as err:
            raise LogitsProcessorError(f"{name} raised {type(err).__name__}: {err}") from err
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != (vocab,):
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise LogitsProcessorError(f"{name} must return a tensor of shape ({vocab},), got {got}")
        if not result.is_floating_point():
            raise LogitsProcessorError(f"{name} returned a non-float tensor ({result.dtype})")
        top = float(result.max())  # one pass: NaN anywhere makes it NaN
        if math.isnan(top) or top == math.inf:
            raise LogitsProcessorError(f"{name} returned NaN or +inf")
        if top == -math.inf:
            raise LogitsProcessorError(f"{name} left no token with a finite logit")
        row = result.to(device=row.device, dtype=row.dtype)
    return row
