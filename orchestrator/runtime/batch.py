"""Batches of any structure, as users' training code has them: how a batch reaches the device,
how the model is called on it, how the loss is taken and how many samples it holds.

- `(input, target)` (a tuple or list of two) with `model.loss` cross_entropy / mse: `model(input)`
  against `target`, as a hand-written loop does (the loop's fast path, `Feed.pair`);
- a dict (`input_ids`, `attention_mask`, `labels`: the Hugging Face convention): `model(**batch)`;
  with cross_entropy / mse its `labels` are the target and the other keys the model's inputs;
- `model.loss=model`: the output is the loss, or has `.loss` / `["loss"]`; a tuple or list batch is
  called as `model(*batch)`, a tensor as `model(batch)`;
- `model.loss={_target_, args}`: `fn(output, batch, **args)`, the output of `model(**batch)`, of
  `model(batch[0])` for a tuple or list, of `model(batch)` for a tensor.

Tensors anywhere in the batch (nested dicts, tuples, lists) are moved with `non_blocking` (the
DataLoader's `pin_memory` pins them all). The batch size is the leading dimension of
`data.batch_key`, or of the first tensor found. `Feed.check` reads the run's first real batch and
turns a wrong combination into one line naming what it found (a ConfigError, as the rank reports it).
A dict batch with an `attention_mask` also counts its real tokens (the mask's ones) and the
positions computed: real tokens/s and the padding's share (`summary.token_figures`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ..schema import Config, ConfigError, Loss, Mode, Objective, import_target

TARGET_KEY = "labels"  # a dict batch's target for model.loss=cross_entropy / mse
MASK_KEY = "attention_mask"  # a dict batch's real tokens (1) and padding (0): real tokens/s


def loss_fn(kind: Loss) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind is Loss.mse:
        return nn.functional.mse_loss

    def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.dim() > 2:  # sequence models: (B, T, V) logits against (B, T) targets
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return nn.functional.cross_entropy(out, target)

    return cross_entropy


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (non_blocking: pinned memory copies async)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)  # OrderedDict, a BatchEncoding
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The first tensor in `batch`, depth first (a dict in its keys' order)."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        found = first_tensor(v)
        if found is not None:
            return found
    return None


def describe(batch: Any) -> str:
    """What a batch is, for an error line: `a dict with keys input_ids, labels`."""
    if isinstance(batch, Mapping):
        return f"a dict with keys {', '.join(map(str, batch)) or '(none)'}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} item(s)"
    if isinstance(batch, torch.Tensor):
        return f"one tensor of shape {tuple(batch.shape)}"
    return f"a {type(batch).__name__}"


def loss_of(output: Any) -> torch.Tensor:
    """model.loss=model: the output itself, its `.loss`, or its `["loss"]`."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        keys = f" (keys {', '.join(map(str, output))})" if isinstance(output, Mapping) else ""
        raise ConfigError(f"model.loss=model: the model returned a {type(output).__name__}{keys} with no loss tensor "
                          f"(the output itself, .loss or ['loss']); return the loss, or set model.loss to "
                          f"cross_entropy, mse or a {{_target_: ...}} callable (output, batch) -> loss")
    return loss


def no_tokens(batch: Any) -> str:
    """The one line that refuses a trial of tune.objective=tokens whose batches hold no mask."""
    return (f"tune.objective=tokens: the batch is {describe(batch)}, with no '{MASK_KEY}' tensor to count its real "
            f"tokens by (only dict batches with one have tokens/s); use tune.objective=throughput (samples/s), or a "
            f"collate that returns '{MASK_KEY}'")


class Feed:
    """The run's batches to the model and the loss, decided from the first batch (`check`)."""

    def __init__(self, cfg: Config) -> None:
        spec = cfg.model.loss
        self.kind: Optional[Loss] = spec if isinstance(spec, Loss) else None
        self.custom: Optional[Callable[..., torch.Tensor]] = None
        if self.kind is None:
            self.custom = functools.partial(import_target(spec["_target_"]), **(spec.get("args") or {}))
        self.criterion = loss_fn(self.kind) if self.kind in (Loss.cross_entropy, Loss.mse) else None
        self.batch_key = cfg.data.batch_key
        self.pair = False  # (input, target) with cross_entropy / mse: the loop's own fast path
        self.masked = False  # a dict batch with an attention_mask: its real tokens are counted
        # a study's trial judged by real tokens/s (tune.objective=tokens) needs them: refused at the first batch
        self.tokens_needed = cfg.mode is Mode.tune and cfg.tune.objective is Objective.tokens
        self.checked = False

    @property
    def loss_name(self) -> str:
        return f"model.loss={self.kind.value}" if self.kind is not None else "model.loss._target_"

    def check(self, batch: Any, model: nn.Module) -> None:
        """The first batch fits `model.loss` and the model's forward, and holds a batch size; else
        one ConfigError line naming what was found."""
        self.pair = self.criterion is not None and isinstance(batch, (tuple, list)) and len(batch) == 2
        if self.criterion is not None and not self.pair:
            if not isinstance(batch, Mapping):
                raise ConfigError(f"{self.loss_name} takes (input, target) batches or a dict with '{TARGET_KEY}'; "
                                  f"the batch is {describe(batch)}; set model.loss=model (the model returns its loss) "
                                  f"or a {{_target_: ...}} callable (output, batch) -> loss")
            if TARGET_KEY not in batch:
                raise ConfigError(f"{self.loss_name}: the batch is {describe(batch)}, no '{TARGET_KEY}' to take the loss "
                                  f"against; set model.loss=model (the model returns its loss) or a {{_target_: ...}} "
                                  f"callable (output, batch) -> loss")
        if isinstance(batch, Mapping):
            self._check_forward(batch, model)
            self.masked = isinstance(batch.get(MASK_KEY), torch.Tensor)
        elif self.criterion is None and self.custom is None and isinstance(batch, (tuple, list)):
            self._check_positional(batch, model)
        if self.tokens_needed and not self.masked:
            raise ConfigError(no_tokens(batch))
        self.size(batch)
        self.checked = True

    @staticmethod
    def tokens(batch: Mapping) -> tuple:
        """(real tokens, positions computed) of a batch with an attention_mask, counted where the
        loader left it (host memory: no device sync)."""
        mask = batch[MASK_KEY]
        return int(mask.count_nonzero()), mask.numel()

    def _check_forward(self, batch: Mapping, model: nn.Module) -> None:
        """model(**batch): every key the model is given must be an argument of its forward."""
        inner = getattr(model, "module", model)  # DataParallel / DDP
        try:
            params = inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            return
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return
        given = [k for k in batch if not (self.criterion is not None and k == TARGET_KEY)]
        unknown = [str(k) for k in given if k not in params]
        if unknown:
            raise ConfigError(f"data: the batch is {describe(batch)}; the model is called as model(**batch) and "
                              f"{type(inner).__name__}.forward({', '.join(params)}) takes no {', '.join(unknown)}")

    def _check_positional(self, batch: Any, model: nn.Module) -> None:
        """model.loss=model with a tuple batch: model(*batch) must take its items."""
        inner = getattr(model, "module", model)  # DataParallel / DDP
        try:
            signature = inspect.signature(inner.forward)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(*batch)
        except TypeError:
            raise ConfigError(f"{self.loss_name}: the batch is {describe(batch)} and the model is called as "
                              f"model(*batch), but {type(inner).__name__}.forward({', '.join(signature.parameters)}) "
                              f"does not take {len(batch)} argument(s); for (input, target) batches set "
                              f"model.loss=cross_entropy or mse, or a {{_target_: ...}} callable (output, batch) -> loss"
                              ) from None

    def size(self, batch: Any) -> int:
        """Samples in the batch: the leading dimension of data.batch_key, or of its first tensor."""
        if self.batch_key is not None:
            if not isinstance(batch, Mapping) or self.batch_key not in batch:
                raise ConfigError(f"data.batch_key: '{self.batch_key}' is not a key of the batch ({describe(batch)})")
            found = first_tensor(batch[self.batch_key])
        else:
            found = first_tensor(batch)
        if found is None or found.dim() == 0:
            raise ConfigError(f"data: no tensor with a batch dimension in the batch ({describe(batch)}); "
                              f"set data.batch_key to the key that holds one")
        return int(found.shape[0])

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The micro-batch's loss (any batch but the fast path's (input, target))."""
        return self.forward(model, batch)[0]

    def forward(self, model: nn.Module, batch: Any) -> Tuple[torch.Tensor, Any]:
        """(the loss, the model's output) of one forward: evaluation reads a metric off the output."""
        if isinstance(batch, Mapping):
            if self.criterion is not None:
                inputs: Dict[str, Any] = {k: v for k, v in batch.items() if k != TARGET_KEY}
                output = model(**inputs)
                return self.criterion(self._logits(output), batch[TARGET_KEY]), output
            output = model(**batch)
        elif self.criterion is not None:
            x, y = batch
            output = model(x)
            return self.criterion(self._logits(output), y), output
        elif isinstance(batch, (tuple, list)):
            output = model(*batch) if self.custom is None else model(batch[0])
        else:
            output = model(batch)
        if self.custom is None:
            return loss_of(output), output
        loss = self.custom(output, batch)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(f"model.loss._target_: returned a {type(loss).__name__}, not a loss tensor")
        return loss, output

    def _logits(self, output: Any) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise ConfigError(f"{self.loss_name}: the model returned a {type(output).__name__}, not a tensor to take "
                              f"the loss of; set model.loss=model (it returns its loss, .loss or ['loss']) or a "
                              f"{{_target_: ...}} callable (output, batch) -> loss")
        return output
