"""The models of the built-in tasks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. 40-256-256-10 for MNIST-1D."""

    def __init__(self, sizes: tuple = (40, 256, 256, 10)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        # unpacked, not sliced: a slice of a ModuleList builds a new Module (7 against 0.8 us)
        *hidden, last = self.layers
        for layer in hidden:
            x = F.relu(layer(x))
        return last(x)


class Conv1DNet(nn.Module):
    """The MNIST-1D paper's CNN: three strided convolutions and a linear head (5,210 parameters)."""

    def __init__(self, length: int = 40, channels: int = 25, classes: int = 10):
        super().__init__()
        self.length = length
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        out = length
        for k in (5, 3, 3):
            out = (out + 2 - k) // 2 + 1
        self.head = nn.Linear(channels * out, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, self.length)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.head(x.flatten(1))


class Conv2DNet(nn.Module):
    """A small CNN for 28x28 images (MNIST, Fashion-MNIST), cheap enough for CPUs."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, stride=2, padding=2)   # 28 -> 14
        self.conv2 = nn.Conv2d(16, 32, 5, stride=2, padding=2)  # 14 -> 7
        self.head = nn.Linear(32 * 7 * 7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 28, 28)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.head(x.flatten(1))


class SparseLinear(nn.Module):
    """Linear classifier over sparse features whose gradient touches only active features.

    The weights are an ``EmbeddingBag`` with ``sparse=True``: backward yields a
    sparse gradient holding just the rows of the features present in the batch,
    so concurrent Hogwild updates rarely touch the same memory (the setting of
    the Hogwild paper). Index ``features`` is padding and never learns.
    """

    def __init__(self, features: int, classes: int = 2):
        super().__init__()
        self.features = features
        self.weight = nn.EmbeddingBag(features + 1, classes, mode="sum", sparse=True,
                                      padding_idx=features)
        nn.init.zeros_(self.weight.weight)
        self.bias = nn.Parameter(torch.zeros(classes))

    def forward(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.weight(indices, per_sample_weights=values) + self.bias


class TinyLM(nn.Module):
    """A GPT-style byte-level language model: token and position embeddings, ``layers``
    pre-norm causal transformer blocks (heads of ``HEAD_WIDTH``), a final norm and a head.

    Dropout is off: runs of every mode are compared on the same arithmetic, and the
    generated corpus does not overfit at these sizes.
    """

    HEAD_WIDTH = 32

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 4, context: int = 64):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, width // self.HEAD_WIDTH, 4 * width, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        mask = self.causal[:length, :length]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                           reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy per token of (batch, length, vocab) logits. ``reduction="sum"`` sums the
    *per-sequence means* over the batch, so a test set's sum / sequences is the mean loss
    per token (what perplexity is the exp of) whatever the length."""
    flat = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    if reduction == "sum":
        return flat / targets.shape[1]
    if reduction == "mean":
        return flat / targets.numel()
    raise ValueError(f"reduction {reduction!r}: use 'mean' or 'sum'")


class DLRMDense(nn.Module):
    """DLRM's dense part: a bottom MLP for the dense features, the dot products of every
    pair of its vector and the features' embedding vectors, a top MLP and one logit.

    What a baseline trains beside tables held elsewhere (an RPC parameter server, TorchRec):
    ``forward(dense, vectors)`` takes the looked-up vectors, ``[n, features, dim]``."""

    def __init__(self, features: int = 26, dense: int = 13, dim: int = 16,
                 bottom: tuple = (64,), top: tuple = (64,)):
        super().__init__()
        self._dense_part(features, dense, dim, bottom, top)

    def _dense_part(self, features: int, dense: int, dim: int, bottom: tuple, top: tuple):
        self.bottom = MLP((dense, *bottom, dim))
        vectors = features + 1
        self.top = MLP((dim + vectors * (vectors - 1) // 2, *top, 1))
        pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", pairs, persistent=False)

    def forward(self, dense: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bottom(dense))
        vectors = torch.cat([x.unsqueeze(1), vectors], dim=1)         # [n, features + 1, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class DLRM(DLRMDense):
    """A DLRM-like click model: embedding tables for the categorical features and
    ``DLRMDense`` (bottom MLP, pairwise dot products, top MLP, one logit).

    ``tables`` (1..``features``, default one per feature): feature ``f`` looks up table
    ``f % tables`` at row ``(f // tables) * rows + id``, so the features sharing a table
    each own a block of ``rows`` rows and never collide; table ``t`` holds ``rows`` times
    the number of its features. ``tables=1`` is one table of ``rows * features`` rows (the
    layout of one huge table sharded by row); the default builds, row for row and from the
    same seed, the model of one table per feature. The tables have ``sparse=True``: a
    step's gradient holds only the rows its batch touched. ``rows`` x ``dim`` x
    ``features`` float32s in all: 10^7 x 16 x 26 is 16 GB.
    """

    def __init__(self, rows: int, features: int = 26, dense: int = 13, dim: int = 16,
                 bottom: tuple = (64,), top: tuple = (64,), tables: int = None):
        nn.Module.__init__(self)   # the tables first: the seed draws them before the MLPs
        tables = features if tables is None else tables
        if not 1 <= tables <= features:
            raise ValueError(f"tables={tables}: give 1 to {features} (one per feature)")
        self.rows = rows
        # the features of each table, in the order their ids are concatenated for its lookup
        self.features_of = [list(range(t, features, tables)) for t in range(tables)]
        self.tables = nn.ModuleList(nn.Embedding(rows * len(mine), dim, sparse=True)
                                    for mine in self.features_of)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.1)
        self._dense_part(features, dense, dim, bottom, top)
        # the feature order of the looked-up vectors, tables' features concatenated
        order = torch.tensor([f for mine in self.features_of for f in mine])
        self.register_buffer("unorder", torch.argsort(order), persistent=False)
        # each table's columns and their blocks' first rows: its ids in three torch ops,
        # not two per feature (26 features in one table: ~100 us a call, two calls a step);
        # on the CPU even when built on meta (a worker or a benchmark learning the ids alone)
        self._columns = [(torch.tensor(mine, device="cpu"),
                          torch.arange(len(mine), device="cpu") * rows)
                         for mine in self.features_of]

    def embedding_inputs(self, dense: torch.Tensor, categorical: torch.Tensor) -> list:
        """Per table, in ``self.tables`` order, the int64 row ids the forward looks up: its
        features' columns of ``categorical``, each moved to its feature's block of rows,
        concatenated feature after feature (``len(features_of[t]) * n`` ids). What a worker
        needs to know before the forward: the rows of a batch."""
        device = categorical.device
        return [categorical[:, mine[0]] if len(mine) == 1 else
                (categorical[:, columns.to(device)] + blocks.to(device)).t().reshape(-1)
                for mine, (columns, blocks) in zip(self.features_of, self._columns)]

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        n = len(categorical)
        looked_up = [table(ids).view(-1, n, table.embedding_dim) for table, ids in
                     zip(self.tables, self.embedding_inputs(dense, categorical))]
        vectors = torch.cat(looked_up)[self.unorder].transpose(0, 1)   # [n, features, dim]
        return super().forward(dense, vectors)


def lookup_ids(args: tuple, kwargs: dict) -> torch.Tensor:
    """The ids an ``nn.Embedding``/``nn.EmbeddingBag`` forward (pre-hook ``args``,
    ``kwargs``) looks up."""
    return args[0] if args else kwargs["input"]


def with_lookup_ids(args: tuple, kwargs: dict, ids: torch.Tensor) -> tuple:
    """A forward pre-hook's ``(args, kwargs)`` with the ids looked up replaced by ``ids``."""
    if args:
        return (ids, *args[1:]), kwargs
    return args, {**kwargs, "input": ids}


def embedding_tables(model: nn.Module) -> list:
    """The parameter names of ``model``'s ``nn.Embedding`` and ``nn.EmbeddingBag`` weights,
    in ``named_parameters()`` order: the tables a task serves row by row unless it names
    its own."""
    found = {f"{prefix}.weight" if prefix else "weight"
             for prefix, module in model.named_modules()
             if isinstance(module, (nn.Embedding, nn.EmbeddingBag))}
    return [name for name, _ in model.named_parameters() if name in found]


def binary_logloss(logits: torch.Tensor, targets: torch.Tensor,
                   reduction: str = "mean") -> torch.Tensor:
    """Log loss of one logit per sample against 0/1 targets (integer labels welcome)."""
    return F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype),
                                              reduction=reduction)
