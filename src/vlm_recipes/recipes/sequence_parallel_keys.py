"""What a stage split over sequence ranks (`sequence_parallel_size` > 1) cannot combine with yet, checked when
the recipe loads; what needs the model or the ranks (the family, its heads, the processes) is checked by the
plan and the stage (plan.py, speedups/sequence_parallel.py)."""

from __future__ import annotations


def sequence_parallel_problems(stage) -> list[tuple[str, str]]:
    """What a row split over sequence ranks cannot combine with yet: (the key, why and the fix) each."""
    size = stage.sequence_parallel_size
    if size == 1:
        return []
    t = stage.training
    cannot = [
        (
            stage.parallel not in ("auto", "ddp", "fsdp"),
            "parallel",
            "needs one process per rank: set parallel ddp or fsdp",
        ),
        (
            t.loss_positions_only,
            "training.loss_positions_only",
            "it cuts the whole row's positions, each rank holds a piece: set it false",
        ),
        (
            t.vision_feature_cache,
            "training.vision_feature_cache",
            "not proven with a split row: set it false",
        ),
    ]
    return [(key, f"with sequence_parallel_size {size}: {why}") for refused, key, why in cannot if refused]
