"""Data sources: MNIST-1D generated offline, synthetic sparse data, local IDX files.

Nothing here downloads anything, so every host builds the same data offline; generated sets
are cached as ``.npz`` (never pickle).
"""

from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import DataError
from .files import atomic_write

log = logging.getLogger(__name__)

MNIST1D_DATASET_SEED = 42  # the benchmark's own seed: same data as the paper's
CACHE_FORMAT = 1


def cache_root(cache_dir: Optional[str] = None) -> Path:
    root = cache_dir or os.environ.get("ASYNCSGD_CACHE") or \
        os.path.join(os.path.expanduser("~"), ".cache", "asyncsgd")
    return Path(root)


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: np.savez(fh, **arrays))


def _load_npz(path: Path) -> Optional[dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        return None
    except Exception as exc:  # a torn or foreign file: regenerate rather than fail
        log.warning("ignoring unreadable cache file %s (%s); regenerating", path, exc)
        return None


def mnist1d(samples: int = 5000, cache_dir: Optional[str] = None) -> dict:
    """MNIST-1D arrays ``x, y, x_test, y_test`` (80/20 split), generated once and cached.

    Made with the ``mnist1d`` package's ``make_dataset`` (its ``get_dataset`` would
    download by default); cached because generating 5,000 samples takes over a second."""
    if samples < 10:
        raise DataError(f"mnist1d needs at least 10 samples (got {samples}); use --samples 5000")
    path = cache_root(cache_dir) / f"mnist1d-v{CACHE_FORMAT}-n{samples}-s{MNIST1D_DATASET_SEED}.npz"
    cached = _load_npz(path)
    if cached is not None:
        return cached
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise DataError("the mnist1d package is missing; install it with "
                        "'pip install mnist1d' (or 'pip install -e .')") from exc
    log.info("generating MNIST-1D with %d samples (cached in %s)", samples, path)
    args = get_dataset_args()
    args.num_samples = samples
    args.seed = MNIST1D_DATASET_SEED
    data = make_dataset(args)
    arrays = {k: np.asarray(data[k]) for k in ("x", "y", "x_test", "y_test")}
    arrays["x"] = arrays["x"].astype(np.float32)
    arrays["x_test"] = arrays["x_test"].astype(np.float32)
    arrays["y"] = arrays["y"].astype(np.int64)
    arrays["y_test"] = arrays["y_test"].astype(np.int64)
    try:
        _save_npz(path, **arrays)
    except OSError as exc:
        log.warning("could not cache MNIST-1D in %s (%s); continuing uncached", path, exc)
    return arrays


def sparse_classification(samples: int, features: int = 50_000, nnz: tuple = (20, 60),
                          seed: int = 1234, noise: float = 0.1) -> dict:
    """RCV1-like synthetic binary classification.

    Feature frequencies follow a Zipf law (a few features are common, most are
    rare, as words in documents); each row has ``nnz`` active features with
    positive tf-idf-like values, L2-normalised. Labels come from a hidden
    linear model plus noise, so a linear model can learn them but not perfectly.
    Rows are padded to the longest with index ``features`` and value 0.
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, features + 1, dtype=np.float64)
    p = 1.0 / ranks ** 1.1
    p /= p.sum()
    feature_ids = rng.permutation(features)  # frequent features scattered over the index space
    lengths = rng.integers(nnz[0], nnz[1] + 1, size=samples)
    width = int(nnz[1])
    draws = feature_ids[rng.choice(features, size=(samples, width), p=p)]
    mask = np.arange(width)[None, :] < lengths[:, None]
    indices = np.where(mask, draws, features).astype(np.int64)
    values = rng.exponential(1.0, size=(samples, width)) * mask
    values /= np.linalg.norm(values, axis=1, keepdims=True)
    w_true = rng.standard_normal(features + 1)
    w_true[features] = 0.0
    margin = (w_true[indices] * values).sum(1) * 3.0 + noise * rng.standard_normal(samples)
    labels = (margin > 0).astype(np.int64)
    return {"indices": indices, "values": values.astype(np.float32), "labels": labels}


IDX_FILES = {
    "x": "train-images-idx3-ubyte",
    "y": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped), checking its header against its size."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"{path}: IDX header says shape {shape} ({expected} bytes) "
                        f"but the file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file; used by tests and by users converting data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(n).to_bytes(4, "big") for n in array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(header + array.tobytes())


def mnist_idx(data_dir: Optional[str]) -> dict:
    """MNIST or Fashion-MNIST from the four standard IDX files in ``data_dir``."""
    if not data_dir:
        raise DataError("this task reads MNIST / Fashion-MNIST IDX files: pass "
                        "--data-dir DIR with train-images-idx3-ubyte[.gz] and the other "
                        "three files")
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data-dir {data_dir}: no such directory; point it at the folder "
                        "holding the MNIST IDX files")
    arrays, missing = {}, []
    for key, stem in IDX_FILES.items():
        for candidate in (root / stem, root / (stem + ".gz"),
                          root / stem.replace("-idx", ".idx")):
            if candidate.exists():
                arrays[key] = read_idx(candidate)
                break
        else:
            missing.append(stem)
    if missing:
        raise DataError(f"--data-dir {data_dir} lacks {', '.join(missing)} (optionally .gz); "
                        "these are the standard MNIST / Fashion-MNIST file names")
    for split in ("", "_test"):
        x, y = arrays["x" + split], arrays["y" + split]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{data_dir}: images {x.shape} and labels {y.shape} do not match")
    return arrays
