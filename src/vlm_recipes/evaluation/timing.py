"""Step timing for metrics.json and the benchmark: time to the first step, step time median and p90."""

from __future__ import annotations

import statistics
import time

import psutil
from transformers import TrainerCallback


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, data loading included: from the end of the step before (or the
    start of training) to the end of this one. Trainer fetches a step's batches before `on_step_begin`, so
    a timer started there would leave the data loading out. Time spent evaluating or saving a checkpoint
    between two steps is not a step's."""

    def __init__(self):
        self.first_step_end: float | None = None  # wall clock, to compare with the process start
        self.step_times: list[float] = []
        self._since = 0.0

    def _restart(self, *args, **kwargs):
        self._since = time.perf_counter()

    on_train_begin = on_evaluate = on_save = _restart

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_times.append(now - self._since)
        self._since = now
        if self.first_step_end is None:
            self.first_step_end = time.time()

    def summary(self) -> dict:
        """Seconds from process start (imports and model loading included) to the end of the first step,
        and step time statistics over the steps after the first (the first pays for warm-up)."""
        steady = self.step_times[1:] or self.step_times
        started = psutil.Process().create_time()
        return {
            "time_to_first_step_s": (self.first_step_end - started) if self.first_step_end else None,
            "step_time_median_s": statistics.median(steady) if steady else None,
            "step_time_p90_s": percentile(steady, 0.9) if steady else None,
            "steps_timed": len(self.step_times),
        }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
