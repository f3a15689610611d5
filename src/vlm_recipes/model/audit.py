"""The freeze audit: after a stage, which weights of final/ are bit-identical to the stage's source.

A frozen role must come out exactly as it went in (a 4-bit load, a compute dtype below the checkpoint's,
a cast or a stray optimizer group would each change it silently). Both model directories are loaded the
same way, one at a time, and every parameter is compared by a digest of its bytes; per role the counts
go into report.json, and a frozen role with a changed tensor fails the stage before it is marked done.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from vlm_recipes.caches.keys import content_digest
from vlm_recipes.errors import GuardError
from vlm_recipes.families.base import Family
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.roles import ROLES

log = logging.getLogger(__name__)


class FreezeAuditError(GuardError):
    """A role the stage kept frozen changed."""


def parameter_digests(model_dir: str | Path, dtype: torch.dtype, trust_remote_code: bool) -> dict[str, str]:
    """A digest per parameter of a saved model, loaded on the CPU in `dtype` (the checkpoint's own)."""
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=dtype, trust_remote_code=trust_remote_code
    )
    digests = {name: content_digest(param.data) for name, param in model.named_parameters()}
    del model
    return digests


def audit_freeze(
    source: str,
    final_dir: Path,
    family: Family,
    stage: Stage,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> dict[str, dict[str, int]]:
    """Per role: how many tensors are identical to the source's and how many changed. Raises
    FreezeAuditError when a frozen role changed, naming its tensors."""
    before = parameter_digests(source, dtype, trust_remote_code)
    after = parameter_digests(final_dir, dtype, trust_remote_code)
    audit: dict[str, dict[str, int]] = {}
    changed_frozen: list[str] = []
    for name, digest in after.items():
        role = family.role_of(name) or "other"
        counts = audit.setdefault(role, {"identical": 0, "changed": 0, "new": 0})
        if name not in before:
            counts["new"] += 1
        elif before[name] == digest:
            counts["identical"] += 1
        else:
            counts["changed"] += 1
            if role in ROLES and getattr(stage.train, role) == "frozen":
                changed_frozen.append(name)
    summary = ", ".join(
        f"{role} {c['identical']} identical / {c['changed']} changed" for role, c in audit.items()
    )
    log.info("  freeze audit: %s", summary)
    if changed_frozen:
        raise FreezeAuditError(
            f"stage `{stage.name}`: {len(changed_frozen)} tensor(s) of frozen roles changed during training "
            f"(e.g. {', '.join(changed_frozen[:3])}); final/ is kept for inspection, the stage is not marked done. "
            "This is a bug in vlm-recipes or a custom model's training code: please report it with report.json."
        )
    return audit
