"""How many shard processes a parameter server runs: ``--shards N``, or ``auto``.

Every shard adds a request and a reply to each worker's step, and pays back only when its
slice is large enough to take real work off the others on another core (experiments/README.md,
"Shards"); a resumed run keeps the shard count its checkpoints were written with.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

from asyncsgd.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
SHARD_PAYS_BYTES = 5 * 10 ** 6  # float32 bytes a shard needs before splitting pays (1 trainer)


def auto_shards(params: int, workers: int, cores: int) -> int:
    """The ``auto`` shard count for ``params`` float32 parameters, ``workers`` expected
    workers and ``cores`` cores on the server's host: a shard every ``SHARD_PAYS_BYTES``,
    but no more than the cores the workers leave, were they all on this host (shards +
    workers <= cores), nor than cores // workers (once they keep every core busy, a
    second shard no longer pays); 1 at least. On 2 cores and one worker, 2 shards made 3
    busy processes: at 10 MB they gave 0.97x (TCP) and 0.84x (same host) of 1 shard's
    rate at load 7.4-8.8 (experiments/README.md, "Shards")."""
    workers = max(1, workers)
    return max(1, min(4 * params // SHARD_PAYS_BYTES, cores // workers, cores - workers))


def saved_shards(run_dir: Union[str, Path]) -> Optional[int]:
    """How many shards wrote checkpoints (``shard-I.pt``) into ``run_dir``; None if none; a
    ConfigError when they are not shards 0 to N-1."""
    indices = set()
    for path in Path(run_dir).glob("shard-*.pt"):
        index = path.stem.split("-", 1)[1]
        if index.isdecimal():
            indices.add(int(index))
    if indices and indices != set(range(len(indices))):
        raise ConfigError(f"{run_dir} holds the checkpoints of shards {sorted(indices)}, not "
                          "of shards 0 to N-1: give the run's count with --shards N")
    return len(indices) or None


def shard_count(spec: Union[int, str], params: int, workers: int, cores: int,
                resumed: Optional[Union[str, Path]] = None) -> int:
    """The shards to run: ``spec`` when it is a number; for ``auto``, the count the resumed
    run ``resumed`` saved checkpoints of, else ``auto_shards``."""
    if spec != AUTO:
        if type(spec) is not int or spec < 1:
            raise ConfigError(f"--shards {spec!r}: give auto or a whole number of at least 1")
        if 4 * params < SHARD_PAYS_BYTES * spec and spec > 1:
            log.warning(
                "--shards %d for a model of %.2g MB: every shard adds a request per step, "
                "and below ~%d MB a shard the extra shards cost more than they saved "
                "(experiments/README.md, 'Shards'); --shards auto chooses %d",
                spec, 4 * params / 1e6, SHARD_PAYS_BYTES // 10 ** 6,
                auto_shards(params, workers, cores))
        return spec
    saved = saved_shards(resumed) if resumed is not None else None
    if saved is not None:
        log.info("--shards auto: %d, as the resumed run's shard checkpoints", saved)
        return saved
    count = auto_shards(params, workers, cores)
    log.info("--shards auto: %d for %.3g MB of parameters, %d expected worker(s), %d core(s) "
             "(a shard per %d MB, at most the %d core(s) the workers leave and cores // "
             "workers)", count, 4 * params / 1e6, workers, cores, SHARD_PAYS_BYTES // 10 ** 6,
             max(0, cores - max(1, workers)))
    return count
