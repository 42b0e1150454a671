"""Objects the Slurm test ships to its workers (importable there: same checkout path)."""

from __future__ import annotations

import time


class Counter:
    """A stand-in service: state that lives in one worker, lost if that worker goes."""

    def __init__(self) -> None:
        self.n = 0

    def incr(self) -> int:
        self.n += 1
        return self.n


def busy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
