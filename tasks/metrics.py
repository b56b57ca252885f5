"""Validation metrics (trainer.val_metric): callables `fn(output, batch, **args)` returning the
batch's mean over its items, a tensor or a float; the orchestrator weighs each batch by its items
and averages over the whole validation set and the ranks (orchestrator/runtime/evaluate.py).

    trainer.val_metric={_target_:tasks.metrics.accuracy}
    'trainer.val_metric={_target_:tasks.metrics.accuracy,args:{shift:true}}'   # a causal LM's next token
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

IGNORE = -100  # labels at padding (tasks/sequences.py): not counted


def accuracy(output: Any, batch: Any, shift: bool = False) -> torch.Tensor:
    """The share of items whose highest-scoring class is the target. `output`: the logits, or a
    model's {"logits": ...} / `.logits`; the target: an (input, target) batch's second item or a
    dict batch's "labels". For sequences, each item's share of its real tokens (labels not -100),
    averaged over the items; `shift`: the logits at position t predict the label at t + 1 (a causal
    LM given its inputs as labels, such as tasks.sequences.CausalLM)."""
    logits = output["logits"] if isinstance(output, Mapping) else getattr(output, "logits", output)
    target = batch["labels"] if isinstance(batch, Mapping) else batch[1]
    if shift:
        logits, target = logits[:, :-1], target[:, 1:]
    correct = (logits.argmax(dim=-1) == target).float()
    if correct.dim() == 1:
        return correct.mean()
    correct, real = correct.reshape(len(correct), -1), (target != IGNORE).reshape(len(target), -1).float()
    return ((correct * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)).mean()
