"""Messages that hold, and dependency warnings fixed at their cause: in-process, no training."""

from __future__ import annotations

import os
import warnings

import torch

from orchestrator.app import _say_workers_over_cores
from orchestrator.rank import _hush_said_warnings
from orchestrator.tune.report import _pruning_line, interval_words
from orchestrator.tune.space import knob_words


def test_the_shipped_transformer_returns_its_own_logits_not_a_view():
    """FSDP2 hooks a wrapped module's output for the backward all-gather and warns ("returned a
    view tensor ... wrong gradients") when it is a view, as nn.Linear's 3-D output is."""
    from tasks.models import TinyTransformerLM

    out = TinyTransformerLM()(torch.randint(0, 256, (2, 64)))
    assert out.shape == (2, 64, 256) and out._base is None


def test_more_workers_than_cores_is_said_once_in_our_words(make_cfg, monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    _say_workers_over_cores(make_cfg("data.num_workers=4"), local_ranks=2)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[orchestrator] note: data.num_workers=4 per rank (8 loader processes on this machine) is more than "
                   "the 2 CPU cores this process may use: the workers share them (torch suggests at most 2); lower "
                   "data.num_workers unless the loader waits on I/O, or let trainer.loader_autotune=true measure it"]
    _say_workers_over_cores(make_cfg("data.num_workers=2"), local_ranks=1)
    assert capsys.readouterr().out == ""
    # the ranks do not repeat torch's version of it (twice per loader: construction and iterator)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _hush_said_warnings()
        torch.utils.data.DataLoader(list(range(8)), num_workers=2)
    assert not [w for w in seen if "worker processes in total" in str(w.message)]


def test_pruning_that_saved_nothing_says_so():
    saved = _pruning_line({"pruner": "median", "pruned": 1, "saved_s": 0.0, "spent_s": 9.5, "median_s": 4.0})
    assert saved == ("[tune] pruning (median) stopped 1 trial early but saved no trial time: it ran 9.5s in all, "
                     "where a completed trial takes 4.0s (median)")
    assert _pruning_line({"pruner": "interval", "pruned": 3, "saved_s": 12.4, "spent_s": 2.0, "median_s": 4.8,
                          "within_noise_of_best": [5]}) == (
        "[tune] pruning (interval) stopped 3 trials early, saving about 12s of trial time; trial 5 had a last window "
        "within the best's interval")


def test_knobs_that_do_not_apply_are_not_listed():
    assert knob_words({"data.batch_size": 64, "data.num_workers": 0, "data.prefetch_factor": None,
                       "data.persistent_workers": False}) == "batch_size=64 num_workers=0"
    assert knob_words({"data.num_workers": 2, "data.persistent_workers": True}) == "num_workers=2 persistent_workers=True"


def test_an_interval_is_shown_from_0_at_least():
    """A trial stopped at max_measure_s after 2 windows: rel_se 10% and t(1) = 12.7 give a 95%
    interval of 1412.9 +- 1715 (seen in the README's study as `1412.9 (-302.1-3127.8) samples/s`)."""
    assert interval_words({"throughput_lo": -302.1, "throughput_hi": 3127.8}, "throughput") == " (0.0-3127.8)"
    assert interval_words({"throughput_lo": 1272.0, "throughput_hi": 1554.0}, "throughput", 1.0, "{:.0f}") == " (1272-1554)"
    assert interval_words({"throughput": 5.0}, "throughput") == ""
