"""A shaped link: ``--link 100mbit``, and the token-bucket qdisc (tbf) that makes it on both
ends of a host's veth pair, so what it sends and what it receives are each limited.

Only ``sch_tbf`` is needed; ``netem`` (delay, loss) is not used, as many kernels lack it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
MIN_BPS = 100e3  # below this a frame takes > 0.1 s: not a link anyone trains over
MAX_BPS = 100e9
# tbf's bucket: 1 ms of the rate, at least 16 KiB (what a real NIC sends back to back); a
# one-frame bucket makes each frame wait for its own timer tick. Its queue: 10 ms, the
# smallest that gave the full rate (experiments/README.md, "Link shaping").
BURST_SECONDS = 1e-3
MIN_BURST = 16 * 1024
LATENCY = "10ms"
FORMS = "a number and kbit, mbit or gbit, e.g. 100mbit, 1gbit, 2.5gbit or 500kbit"


def parse_rate(text: str, flag: str = "--link") -> float:
    """``'100mbit'`` -> 1e8 bits per second; ConfigError naming the accepted forms."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*", str(text))
    if not m:
        raise ConfigError(f"{flag} {text}: write {FORMS}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in UNITS:
        hint = " (tc's 'bps' means bytes per second: write mbit for megabits)" \
            if unit.endswith("bps") else ""
        raise ConfigError(f"{flag} {text}: unknown unit {m.group(2)!r}{hint}; write {FORMS}")
    bps = number * UNITS[unit]
    if not MIN_BPS <= bps <= MAX_BPS:
        raise ConfigError(f"{flag} {text} is outside 100kbit..100gbit")
    return bps


@dataclass(frozen=True)
class Link:
    """One host's link: the same rate each way. tbf counts whole Ethernet frames, so TCP's
    payload gets 1448/1514 = 95.6% of the rate."""

    bits_per_second: float
    text: str

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["Link"]:
        """None for no link (unshaped), else the parsed rate."""
        if text is None:
            return None
        return cls(parse_rate(text), str(text).strip())

    @property
    def burst(self) -> int:
        return max(MIN_BURST, int(self.bits_per_second / 8 * BURST_SECONDS))

    def tbf(self) -> list:
        """The qdisc, as ``tc qdisc replace dev DEV root`` takes it."""
        return ["tbf", "rate", f"{int(self.bits_per_second)}bit", "burst", str(self.burst),
                "latency", LATENCY]

    def describe(self) -> str:
        """E.g. '100mbit each way (tbf, burst 16384 B, latency 10ms)'."""
        return f"{self.text} each way (tbf, burst {self.burst} B, latency {LATENCY})"
