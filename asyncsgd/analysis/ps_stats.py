"""The short summary ``asyncsgd ps-stats`` prints of a server's STATS reply: a dozen lines (who
is connected, updates, staleness, trouble) instead of its long JSON (``--json`` keeps that).

Pure functions of the reply's dict: missing keys shorten the summary instead of failing.
"""

from __future__ import annotations


from ..wire.stats import STALENESS_BUCKETS, percentile

LABEL = 13  # the width of the label column
SHOWN_WORKERS = 8  # workers listed one per line; more are counted ("--json" has them)
# Counters worth a word only when they are not zero: (key, what it counts).
RARE = (("refused_workers", "workers refused by a shard"),
        ("nonfinite", "NaN/Inf gradients refused"),
        ("too_large", "gradients over --max-grad-norm refused"),
        ("stale", "stale sync pushes not applied"),
        ("dropped_workers", "silent workers dropped"),
        ("forgotten_workers", "workers forgotten"),
        ("lost_updates", "acknowledged updates lost to a shard restart"),
        ("dc_uncompensated", "pushes without delay compensation"))


def _at_least(value: int, hist: list) -> str:
    """A shard's last bucket counts everything from its index up (servers/shard.py caps
    staleness at STALENESS_BUCKETS - 1)."""
    return f">={value}" if value == len(hist) - 1 == STALENESS_BUCKETS - 1 else str(value)


def staleness_line(hist: list) -> str:
    """p50, p99 and max of the merged staleness histogram, and how many pushes it holds."""
    total = sum(hist)
    if not total:
        return "no pushes yet"
    top = max(i for i, count in enumerate(hist) if count)
    p50, p99 = percentile(hist, 0.5), percentile(hist, 0.99)
    return (f"p50 {_at_least(p50, hist)}, p99 {_at_least(p99, hist)}, "
            f"max {_at_least(top, hist)} (versions behind, over {total} pushes)")


def _line(label: str, text: str) -> str:
    return f"{label:<{LABEL}}{text}"


def _shards(stats: dict) -> list:
    """Each shard's counters: the front's ``shard_stats``, or a shard's own reply."""
    if "shard_stats" in stats:
        return list(stats["shard_stats"] or [])
    return [stats] if "shard" in stats else []


def _total(shards: list, key: str) -> int:
    return sum(s.get(key) or 0 for s in shards)


def _worker_lines(stats: dict) -> list:
    """One line per worker the shards last reported, when there are few."""
    workers, left = stats.get("workers") or {}, set(stats.get("left") or [])
    lines = []
    for name, w in list(workers.items())[:SHOWN_WORKERS]:
        state = "left" if name in left else "live" if w.get("alive") else "silent"
        seen = w.get("last_seen_s")
        lines.append(f"  {name:<{LABEL - 3}} {w.get('pushes', 0)} pushes, {state}"
                     + (f", last seen {seen:.1f} s ago" if seen is not None else ""))
    if len(workers) > SHOWN_WORKERS:
        lines.append(f"  ... and {len(workers) - SHOWN_WORKERS} more (--json lists them)")
    return lines


def summary_lines(stats: dict, server: str = "") -> list:
    """The summary of a STATS reply, one string per line (about 8 + one per worker)."""
    shards = _shards(stats)
    curve = stats.get("authenticated")
    security = ("(CURVE: authenticated, encrypted)" if curve else
                "(no CURVE: unauthenticated)" if curve is False else "")
    lines = [_line("server", " ".join(part for part in (server, security) if part))]
    if stats.get("task"):
        lines.append(_line("task", stats["task"]))
    ports = stats.get("shard_ports") or []
    count = stats.get("shards", len(shards))
    lines.append(_line("consistency", f"{stats.get('consistency', '?')}, {count} shard"
                       + ("s" if count != 1 else "")
                       + (f" (ports {', '.join(map(str, ports))})" if ports else "")))
    per_shard = ", ".join(f"shard {s.get('shard', i)}: {s.get('updates', 0)}"
                          for i, s in enumerate(shards))
    lines.append(_line("updates", f"{stats.get('updates', _total(shards, 'updates'))} applied"
                       + (f" ({per_shard})" if len(shards) > 1 else "")
                       + f", {_total(shards, 'pushes')} pushes, {_total(shards, 'pulls')} "
                       "pulls received"))
    restored = [s["restored"] for s in shards if s.get("restored")]
    if restored:
        lines.append(_line("resumed", "from checkpoint version(s) "
                           + ", ".join(str(r.get("version")) for r in restored)))
    if "roster" in stats or "live" in stats:
        lines.append(_line("workers", f"{stats.get('roster', 0)} joined, "
                           f"{len(stats.get('live') or [])} live, "
                           f"{len(stats.get('left') or [])} left"))
    lines += _worker_lines(stats)
    hist = stats.get("staleness") or []
    lines.append(_line("staleness", staleness_line(hist)))
    lines.append(_line("refused", f"{stats.get('refused_connections', 0)} connections at "
                       f"the ZeroMQ/CURVE handshake, {stats.get('refused_handshakes', 0)} "
                       "workers with another model or data"))
    lines.append(_line("errors", f"{_total(shards, 'rejected')} requests rejected, "
                       f"{_total(shards, 'duplicates')} duplicate pushes (re-sent, not "
                       "applied twice)"))
    rare = [f"{_total(shards, key)} {what}" for key, what in RARE if _total(shards, key)]
    if rare:
        lines.append(_line("also", "; ".join(rare)))
    return lines


def summary(stats: dict, server: str = "") -> str:
    """``summary_lines`` as text, for printing."""
    return "\n".join(summary_lines(stats, server))
