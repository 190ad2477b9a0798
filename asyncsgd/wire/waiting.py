"""What a client says while it waits for a server that does not answer yet: a line at once,
then one every few seconds, so a wrong address or a server not started shows at a glance.

A pure object driven by the caller's clock; the caller prints what ``due`` returns.
"""

from __future__ import annotations

from typing import Optional

GRACE = 1.0  # a server that is up answers well within this: no line for it
EVERY = 5.0  # seconds between the lines after the first


class Waiting:
    """The lines a client waiting for ``endpoint`` prints, from ``start`` until it gives up
    ``timeout`` seconds later (``time.monotonic()`` seconds): the first ``grace`` seconds
    in, then one every ``every`` seconds."""

    def __init__(self, endpoint: str, timeout: float, start: float, grace: float = GRACE,
                 every: float = EVERY):
        self.endpoint, self.timeout, self.start, self.every = endpoint, timeout, start, every
        self.next = start + grace  # when the next line is due
        self.said = 0  # lines said so far

    def due(self, now: float) -> Optional[str]:
        """The line to print at ``now``, or None (a late call does not make up the lines
        it missed)."""
        if now < self.next:
            return None
        waited = now - self.start
        self.next = now + self.every
        self.said += 1
        if self.said == 1:
            return (f"waiting for the server at {self.endpoint} (nothing answers there yet); "
                    f"giving up after {self.timeout:g} s (--server-timeout)")
        return (f"still waiting for the server at {self.endpoint}: {waited:.0f} s of "
                f"{self.timeout:g} s")

    def until_due(self, now: float) -> float:
        """Seconds from ``now`` until the next line is due (0 when it is)."""
        return max(0.0, self.next - now)
