"""A language task as users' own code has it (experiment=variable_length_lm): token sequences of
different lengths, a collate function that pads them into dict batches (`input_ids`,
`attention_mask`, `labels`, the Hugging Face convention), and a small causal LM that computes
its own loss (`model.loss=model`, called as `model(**batch)`).

The loss is the mean over sequences of each sequence's mean token loss: every sequence weighs
the same, so with data parallelism (each rank's loss averaged over the ranks) it is exactly the
loss of one process over the same global batch, whatever each rank's padding.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

IGNORE = -100  # labels at padding: no loss (torch's cross_entropy ignore_index default)


class VariableLengthTokens(Dataset):
    """`size` sequences of `min_len`..`max_len` tokens in 1..vocab-1 (0 is the padding id). Each is a
    walk with its own stride (t[i+1] = t[i] + stride mod vocab), learnable from the tokens so far.
    Items are dicts {"input_ids": (length,)}; deterministic given `seed`."""

    def __init__(self, size: int = 1024, min_len: int = 8, max_len: int = 64, vocab: int = 128, seed: int = 0) -> None:
        if not 2 <= min_len <= max_len:
            raise ValueError(f"data.args: need 2 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_len, max_len + 1, (size,), generator=g)
        self.starts = torch.randint(1, vocab, (size,), generator=g)
        self.strides = torch.randint(1, 4, (size,), generator=g)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        n = int(self.lengths[idx])
        walk = (self.starts[idx] - 1 + self.strides[idx] * torch.arange(n)) % (self.vocab - 1) + 1
        return {"input_ids": walk}


def pad_collate(items: List[Dict[str, torch.Tensor]], pad_id: int = 0,
                multiple_of: int = 1) -> Dict[str, torch.Tensor]:
    """Pads a list of {"input_ids": (length,)} to the longest (rounded up to `multiple_of`):
    {"input_ids", "attention_mask" (1 on real tokens), "labels" (IGNORE at padding)}, each (B, T)."""
    longest = max(len(it["input_ids"]) for it in items)
    width = -(-longest // multiple_of) * multiple_of
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        ids[i, :n] = it["input_ids"]
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class CausalLM(nn.Module):
    """Embedding + `n_layers` causal self-attention blocks + a tied head. `forward(input_ids,
    attention_mask, labels)` returns {"loss", "logits"} (the loss when labels are given): each
    position predicts the next token; padding (right of every sequence) is never attended by a real
    token, and its labels are ignored."""

    def __init__(self, vocab: int = 128, d_model: int = 64, n_heads: int = 2, n_layers: int = 1,
                 max_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        for emb in (self.tok, self.pos):  # small, as GPT-2 starts them: the tied head's logits start near 0
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        t = input_ids.shape[1]
        h = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        for block in self.blocks:
            h = block(h, src_mask=causal, is_causal=True)
        logits = self.norm(h) @ self.tok.weight.t()
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = sequence_mean_loss(logits[:, :-1], labels[:, 1:])
        return out


def sequence_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each one's mean token loss (IGNORE targets left out)."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                                reduction="none").view(targets.shape)
    real = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / real).mean()


def smoothed_loss(output: Dict[str, torch.Tensor], batch: Dict[str, torch.Tensor],
                  smoothing: float = 0.1) -> torch.Tensor:
    """A loss of one's own (`model.loss={_target_: tasks.sequences.smoothed_loss, args: {smoothing: 0.1}}`):
    label-smoothed next-token cross-entropy over the real tokens, per sequence, then averaged."""
    logits, targets = output["logits"][:, :-1], batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                                reduction="none", label_smoothing=smoothing).view(targets.shape)
    real = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / real).mean()
