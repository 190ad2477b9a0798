"""A shaped link: ``--link 100mbit``, and the token-bucket qdisc that makes it.

    link = Link.parse("100mbit")     # Link(bits_per_second=100_000_000, text='100mbit')
    link.tbf()                       # ["tbf", "rate", "100000000bit", "burst", "16384", ...]

Every host's link (``run.hosts``) gets a ``tbf`` qdisc on both ends of its
veth pair, so what it sends and what it receives are each limited to the rate.
tbf counts whole Ethernet frames, so TCP's payload gets 1448/1514 = 95.6% of
the rate (measured: 95.6 Mbit/s at 100mbit, 956 at 1gbit, 19.1 at 20mbit).

Why these parameters (measured here, two namespaces, one TCP stream, 2.5 s):

- ``burst``: the bucket, in bytes. One frame (1600) left 100mbit at 68-88
  Mbit/s of payload: each frame then waits for its own timer tick. 1 ms of the
  rate (12.5 KB at 100mbit) with latency 10ms reached the full 95.6; so does
  64 KiB. Hence 1 ms of the rate, at least 16 KiB, which is also what a real
  NIC sends back to back.
- ``latency``: how long a frame may wait in the queue before it is dropped
  (the queue's depth: 125 KB at 100mbit). 1 ms (12.5 KB) held 100mbit to
  91.7 Mbit/s with that burst, 68 with a one-frame burst; 10 ms and 50 ms
  both gave the full rate, so 10 ms, the smaller (a deeper queue only adds
  delay when several senders share a link).

The kernel needs the ``tbf`` qdisc (``sch_tbf``); ``netem`` (delay, loss) is
not used, as many kernels lack it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
MIN_BPS = 100e3  # below this a frame takes > 0.1 s: not a link anyone trains over
MAX_BPS = 100e9
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
    """One host's link: the same rate each way."""

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
