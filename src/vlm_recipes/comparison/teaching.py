"""Did a stage teach? Its eval loss and exact match, trained with several seeds, against the same stage at
its start (learning rate ~0: the model it started from, through the same load and eval): a metric teaches
when it moved the right way by more than the seeds' spread (max - min). scripts/demo_learns.py prints it per
demo model; the suite checks it on the pretrained demo models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Teaching:
    loss_fall: float  # start's eval loss minus the worst seed's
    loss_spread: float
    exact_rise: float  # the worst seed's exact match minus the start's
    exact_spread: float

    @property
    def loss_teaches(self) -> bool:
        return self.loss_fall > self.loss_spread

    @property
    def exact_teaches(self) -> bool:
        return self.exact_rise > self.exact_spread


def teaching(start: dict, trained: list[dict]) -> Teaching:
    """`start` and each of `trained`: {"loss": eval loss, "exact": exact match} of one run."""
    losses, exacts = [t["loss"] for t in trained], [t["exact"] for t in trained]
    return Teaching(
        loss_fall=start["loss"] - max(losses),
        loss_spread=max(losses) - min(losses),
        exact_rise=min(exacts) - start["exact"],
        exact_spread=max(exacts) - min(exacts),
    )
