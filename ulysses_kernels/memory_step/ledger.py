"""The replay's ledger: the tensors alive by name, the running sum of their bytes and its peak."""

from __future__ import annotations

import re

__all__ = ["Ledger"]


class Ledger:
    """Tensors alive by name (device bytes), the running sum and its peak, and apart from them
    the host bytes of the activation offload. A name is allocated once and freed once."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.moment = ""
        self.host = 0
        self.host_peak = 0
        self._blips = 0
        self._sums = 0
        self.record = False  # keep what is alive at the peak (debugging the replay)
        self.at_peak: dict[str, int] = {}
        self.moments: dict[str, int] = {}

    def new(self, name: str, nbytes: int, where: str = "") -> str:
        """Allocate ``name``; ``where`` names the moment if it is the peak (else the name does)."""
        if name in self.live:
            raise AssertionError(f"memory_step: {name} allocated twice")
        self.live[name] = nbytes
        self.current += nbytes
        if self.record:
            key = where or re.sub(r"^L\d+\.|bt?\d+\.|\d+$", "", name)
            self.moments[key] = max(self.moments.get(key, 0), self.current)
        if self.current > self.peak:
            self.peak, self.moment = self.current, where or name
            if self.record:
                self.at_peak = dict(self.live)
        return name

    def free(self, *names: str | None) -> None:
        for name in names:
            if name is not None:
                self.current -= self.live.pop(name)

    def rename(self, old: str, new: str) -> str:
        """The same bytes under a new name (a tensor handed on, no allocation)."""
        self.live[new] = self.live.pop(old)
        return new

    def blip(self, nbytes: int, where: str) -> None:
        """A temporary allocated and freed at once."""
        self._blips += 1
        name = self.new(f"_blip{self._blips}", nbytes, where)
        self.free(name)

    def accumulate(self, a: str, b: str, nbytes: int, where: str) -> str:
        """``a + b`` into a new tensor of ``nbytes``; both operands freed; returns its name."""
        self._sums += 1
        name = self.new(f"acc{self._sums}", nbytes, where)
        self.free(a, b)
        return name

    def host_new(self, nbytes: int) -> None:
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def host_free(self, nbytes: int) -> None:
        self.host -= nbytes
