"""Synthetic click-through data shaped like Criteo/DLRM, generated offline from a seed.

13 dense features and 26 categorical ones, each a Zipf(1.1) draw over ``rows`` raw ids; labels
are drawn from a fixed random teacher, whose own test AUC is the ceiling no model passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .scoring import auc

DENSE = 13
CATEGORICAL = 26
ZIPF = 1.1
TEACHER_DIM = 4
# The teacher's distinct vectors per feature: id ranks past this share theirs (rank modulo),
# so the teacher costs kilobytes whatever ``rows`` is, while every id still differs to a student.
TEACHER_VECTORS = 1 << 14
# rank * multiplier stays below 2^63 in int64
MAX_ROWS = 1 << 31
# the teacher's mean logit before its dense part: about a quarter of the labels are clicks
CLICK_LOGIT = -1.6
_BLOCK = 1 << 14
_CDF_CACHE: dict = {}


@dataclass(frozen=True)
class CtrData:
    """One draw: ``dense`` float32 [n, 13], ``categorical`` int64 [n, 26] raw ids in
    ``[0, rows)``, ``labels`` int64 [n] of 0/1 and ``teacher`` float64 [n], the teacher's
    logit (the Bayes-optimal score: labels are Bernoulli(sigmoid(teacher)))."""

    dense: np.ndarray
    categorical: np.ndarray
    labels: np.ndarray
    teacher: np.ndarray


def zipf_cdf(rows: int, exponent: float = ZIPF) -> np.ndarray:
    """P(rank <= r) for r = 1..rows under Zipf(``exponent``) truncated to ``rows`` ranks."""
    key = (rows, exponent)
    if key not in _CDF_CACHE:
        _CDF_CACHE.clear()   # one size at a time: 10^7 ranks are 80 MB
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -exponent)
        _CDF_CACHE[key] = cdf / cdf[-1]
    return _CDF_CACHE[key]


def zipf_ranks(rng: np.random.Generator, rows: int, shape: tuple) -> np.ndarray:
    """Ranks 0..rows-1 (0 the most frequent) drawn by inverse CDF."""
    cdf = zipf_cdf(rows)
    ranks = np.searchsorted(cdf, rng.random(shape), side="right")
    return np.minimum(ranks, rows - 1).astype(np.int64)


def rank_to_id(ranks: np.ndarray, rows: int, multiplier: int, offset: int) -> np.ndarray:
    """The seeded bijection of ranks onto ids, ``(multiplier * rank + offset) % rows`` with
    ``multiplier`` coprime to ``rows``: hot ids are scattered, and no table of ``rows``
    entries is held (a permutation of 10^7 ids per feature would be 2 GB for 26)."""
    return (ranks * multiplier + offset) % rows


class Teacher:
    """The fixed random model that labels the data: a dense linear part, a linear part per
    categorical id and dot products between the ids' vectors of pairs of features."""

    def __init__(self, rows: int, seed: int):
        rng = np.random.default_rng([seed, 0x7EAC])
        self.rows = rows
        vectors = min(rows, TEACHER_VECTORS)
        # the dense part's logit has a standard deviation of about 1.5, each id part about 1:
        # the dense part is learnt within an epoch, the ids' take data
        self.dense_weights = rng.standard_normal(DENSE) * 1.5 / (_DENSE_STD * np.sqrt(DENSE))
        # features differ in weight, as in Criteo a few of them tell most
        weight = rng.dirichlet(np.full(CATEGORICAL, 0.3))
        self.id_bias = rng.standard_normal((CATEGORICAL, vectors)) * np.sqrt(weight)[:, None]
        pair_scale = (2.0 / (TEACHER_DIM * (1.0 - (weight ** 2).sum()))) ** 0.25
        self.id_vectors = rng.standard_normal((CATEGORICAL, vectors, TEACHER_DIM)) \
            * (np.sqrt(weight) * pair_scale)[:, None, None]
        # the id permutation of each feature: a multiplier coprime to rows
        self.multipliers = np.array([_coprime(rng, rows) for _ in range(CATEGORICAL)])
        self.offsets = rng.integers(0, rows, size=CATEGORICAL)
        self.bias = CLICK_LOGIT - self._mean_id_logit() - self.dense_weights.sum() * _DENSE_MEAN

    def _mean_id_logit(self) -> float:
        """The id parts' mean logit under Zipf draws (hot ids' values do not average out)."""
        vectors = self.id_bias.shape[1]
        pmf = np.diff(zipf_cdf(self.rows), prepend=0.0)
        folded = np.bincount(np.arange(self.rows) % vectors, weights=pmf, minlength=vectors)
        linear = float((self.id_bias @ folded).sum())
        mean_vectors = np.einsum("v,fvk->fk", folded, self.id_vectors)
        total = mean_vectors.sum(0)
        return linear + 0.5 * float(total @ total - (mean_vectors ** 2).sum())

    def logits(self, dense: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The teacher's logit of each sample from its dense features and id ranks."""
        # in blocks: a million samples' id vectors at once would be 832 MB
        return np.concatenate([self._logits(dense[i:i + _BLOCK], ranks[i:i + _BLOCK])
                               for i in range(0, len(ranks), _BLOCK)] or [np.zeros(0)])

    def _logits(self, dense: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        vectors_per_feature = self.id_bias.shape[1]
        flat = ranks % vectors_per_feature + np.arange(CATEGORICAL) * vectors_per_feature
        linear = np.take(self.id_bias.reshape(-1), flat).sum(1)
        vectors = np.take(self.id_vectors.reshape(-1, TEACHER_DIM), flat, axis=0)  # [n, 26, k]
        total = vectors.sum(1)
        # sum over pairs f < g of <v_f, v_g>: half of (|sum|^2 - sum of |v|^2)
        pairs = 0.5 * ((total ** 2).sum(1) - (vectors ** 2).sum((1, 2)))
        return self.bias + dense @ self.dense_weights + linear + pairs


def dense_features(z: np.ndarray) -> np.ndarray:
    """Standard normal draws as log-transformed counts, as DLRM feeds Criteo's dense
    features: non-negative and skewed."""
    return np.log1p(np.logaddexp(0.0, z))


def _normal_mean(fn) -> float:
    """E[fn(z)] for z ~ N(0, 1), by quadrature."""
    z = np.linspace(-10.0, 10.0, 20_001)
    weights = np.exp(-z * z / 2)
    return float((fn(z) * weights).sum() / weights.sum())


_DENSE_MEAN = _normal_mean(dense_features)
_DENSE_STD = (_normal_mean(lambda z: dense_features(z) ** 2) - _DENSE_MEAN ** 2) ** 0.5


def _coprime(rng: np.random.Generator, rows: int) -> int:
    while True:
        candidate = int(rng.integers(rows // 3, rows)) | 1 if rows > 2 else 1
        if np.gcd(candidate, rows) == 1:
            return candidate


def generate(samples: int, rows: int, seed: int, teacher: Optional[Teacher] = None,
             stream: int = 0) -> CtrData:
    """``samples`` labelled samples of the data of ``seed`` with ``rows`` ids per feature;
    ``stream`` draws another sample of the same distribution (train 0, test 1)."""
    teacher = teacher or Teacher(rows, seed)
    rng = np.random.default_rng([seed, stream])
    dense = dense_features(rng.standard_normal((samples, DENSE)))
    ranks = zipf_ranks(rng, rows, (samples, CATEGORICAL))
    ids = rank_to_id(ranks, rows, teacher.multipliers, teacher.offsets)
    logits = teacher.logits(dense, ranks)
    labels = (rng.random(samples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return CtrData(dense.astype(np.float32), ids, labels, logits)


def auc_ceiling(data: CtrData) -> float:
    """The teacher's own AUC on ``data``: labels are Bernoulli(sigmoid(teacher logit)), so
    ranking by that logit is Bayes-optimal and no model's AUC on ``data`` is higher, but
    for the chance of the draw."""
    return auc(data.teacher, data.labels)
