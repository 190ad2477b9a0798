"""How a task scores a model on its test set: the ``Metric`` every report, plot, progress line
and ``--target`` uses (built in: ACCURACY, PERPLEXITY, MSE, LOSS, AUC, or your own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch


# Fields of every metrics.jsonl event (and "loss", which eval events carry): no metric's name.
RESERVED = ("event", "t", "samples", "wall", "worker", "loss")


@dataclass(frozen=True)
class Metric:
    """A test-set score: ``name`` keys it in metrics.jsonl and labels it in reports.

    Your own: ``Metric("f1", higher_is_better=True, per_batch=my_sum_fn)``, where
    ``my_sum_fn(outputs, targets)`` returns the batch's *sum* over samples (the mean over
    the test set is taken for you), or ``from_loss=fn`` of the mean test loss. Keep the
    functions module-level so tasks can be sent to spawned processes.
    """

    name: str
    higher_is_better: bool
    per_batch: Optional[Callable] = None   # (outputs, targets) -> sum over the batch
    from_loss: Optional[Callable] = None   # mean test loss -> the score
    whole: Optional[Callable] = None       # (all outputs, all targets) -> the score
    percent: bool = False                   # a fraction, shown (and targeted) as such

    def __post_init__(self):
        given = [f for f in (self.per_batch, self.from_loss, self.whole) if f is not None]
        if len(given) != 1:
            raise ValueError(f"metric {self.name!r}: give exactly one of per_batch, from_loss "
                             "or whole")
        if not self.name.isidentifier() or self.name in RESERVED:
            raise ValueError(f"metric name {self.name!r} must be an identifier (a JSON key "
                             f"and a TensorBoard tag), e.g. 'accuracy', and none of "
                             f"{', '.join(RESERVED)} (fields every event has)")

    def reached(self, value: Optional[float], target: Optional[float]) -> bool:
        """``value`` is at or past ``target`` in the metric's direction."""
        if value is None or target is None or math.isnan(value):
            return False
        return value >= target if self.higher_is_better else value <= target

    def better(self, a: Optional[float], b: Optional[float]) -> bool:
        """``a`` beats ``b`` (a missing value beats nothing)."""
        if a is None or math.isnan(a):
            return False
        if b is None or math.isnan(b):
            return True
        return a > b if self.higher_is_better else a < b

    def best(self, values) -> Optional[float]:
        values = [v for v in values if v is not None and not math.isnan(v)]
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)

    def format(self, value: Optional[float], precise: bool = False) -> str:
        """For people: '91.2%' for a fraction, else four significant digits (``precise``:
        '91.23%', five)."""
        if value is None:
            return "-"
        if self.percent:
            return f"{100 * value:.{2 if precise else 1}f}%"
        return f"{value:.{5 if precise else 4}g}"

    def check_target(self, target: Optional[float]) -> None:
        """A target this metric can reach; raises ValueError naming the fix."""
        if target is None:
            return
        if not math.isfinite(target):
            raise ValueError(f"--target {target}: give a finite number")
        if self.percent and not 0 <= target <= 1:
            raise ValueError(f"--target {target:g}: {self.name} is a fraction, so give a "
                             f"target between 0 and 1 (e.g. 0.9 for 90%)")
        if self.name == "perplexity" and target < 1:
            raise ValueError(f"--target {target:g}: perplexity is at least 1; give e.g. 4.0")
        if self.name == "auc" and not 0 <= target <= 1:
            raise ValueError(f"--target {target:g}: auc lies between 0 and 1; give e.g. 0.75")

    def describe(self) -> dict:
        """What a run directory records about the metric (readers need no task to read it)."""
        return {"name": self.name, "higher_is_better": self.higher_is_better,
                "percent": self.percent}

    @classmethod
    def described(cls, record: Optional[dict]) -> "Metric":
        """The metric a run directory recorded (``describe``), enough to read and rank it;
        run directories from before metrics were recorded scored accuracy."""
        if not record:
            return ACCURACY
        return cls(str(record["name"]), bool(record["higher_is_better"]),
                   from_loss=_unknown, percent=bool(record.get("percent", False)))


def _unknown(loss: float) -> float:
    raise RuntimeError("a metric read from a run directory can rank scores, not compute them")


def correct(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Samples whose argmax is the label."""
    return float((outputs.argmax(1) == targets).sum())


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Per sample, the mean of squared errors over its outputs; summed over the batch."""
    diff = (outputs.reshape(len(outputs), -1) - targets.reshape(len(targets), -1)).float()
    return float(diff.pow(2).mean(1).sum())


def auc(scores, labels) -> float:
    """The area under the ROC curve: the chance that a random positive scores above a random
    negative, ties counting half (Mann-Whitney U over ranks, ties given their mean rank).
    NaN when the labels hold one class only."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    positive = np.asarray(labels).reshape(-1) > 0
    if len(scores) != len(positive):
        raise ValueError(f"auc: {len(scores)} scores but {len(positive)} labels")
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    above = np.cumsum(counts)
    mean_rank = above - (counts - 1) / 2.0       # 1-based ranks, ties their mean
    rank_sum = float(mean_rank[inverse.reshape(-1)][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def auc_of_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """``auc`` of a model's one score per sample (a logit) against 0/1 targets."""
    return auc(outputs.detach().float().cpu().reshape(len(outputs), -1)[:, -1].numpy(),
               targets.detach().cpu().numpy())


def perplexity(mean_loss: float) -> float:
    # overflow: exp(710) is inf in float64, and a diverged model's loss gets there
    return math.exp(min(mean_loss, 700.0))


def identity(mean_loss: float) -> float:
    return mean_loss


ACCURACY = Metric("accuracy", higher_is_better=True, per_batch=correct, percent=True)
PERPLEXITY = Metric("perplexity", higher_is_better=False, from_loss=perplexity)
MSE = Metric("mse", higher_is_better=False, per_batch=squared_error)
LOSS = Metric("test_loss", higher_is_better=False, from_loss=identity)
AUC = Metric("auc", higher_is_better=True, whole=auc_of_outputs)
