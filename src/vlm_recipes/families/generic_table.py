"""What the generic role finder (generic.py) makes of every model type transformers maps to
AutoModelForImageTextToText, each built from its default config on the meta device: the Markdown table in
docs/results/model-types.md, written and checked by
`scripts/vlm_types_table.py`.

A default config is transformers' own (`AutoConfig.for_model(model_type)`): the architecture as its
authors left it by default, not any published checkpoint. Where a type needs more (a sub-config, an
optional library), the row says what building it raised.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from vlm_recipes.families import FAMILIES
from vlm_recipes.families.generic import FoundRoles, RolesNotFound, quiet_transformers, roles_of_config
from vlm_recipes.roles import ROLES

START = "<!-- generic-table:start -->"
END = "<!-- generic-table:end -->"
OUTSIDE_EVERY_ROLE = "parameters outside every role"


@dataclass(frozen=True)
class TypeRow:
    """One model type's line: the roles found, or why not (`refused`: "kind: what is missing")."""

    model_type: str
    family: str | None  # the family module that handles the type, if one does
    found: FoundRoles | None
    refused: str | None
    seconds: float  # building the default config's model and finding its roles

    @property
    def kind(self) -> str:
        """What the summary counts the row as: "roles found" or the refusal's kind."""
        return "roles found" if self.refused is None else self.refused.split(":")[0]


def image_text_to_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def family_of_type() -> dict[str, str]:
    return {model_type: family.name for family in FAMILIES for model_type in family.model_types}


def _outside_every_role(found: FoundRoles) -> str:
    """The modules holding a model's unassigned parameters, in a few words."""
    modules = list(dict.fromkeys(".".join(name.split(".")[:2]) for name in found.unassigned))
    shown = ", ".join(f"`{m}`" for m in modules[:3]) + (", ..." if len(modules) > 3 else "")
    return f"roles not found: {len(found.unassigned)} {OUTSIDE_EVERY_ROLE} ({shown})"


def type_row(model_type: str, families: dict[str, str] | None = None) -> TypeRow:
    from transformers import AutoConfig

    families = family_of_type() if families is None else families
    began = time.perf_counter()
    found, refused = None, None
    try:
        with quiet_transformers():
            config = AutoConfig.for_model(model_type)
        found = roles_of_config(config)
        refused = _outside_every_role(found) if found.unassigned else None
    except RolesNotFound as refusal:
        refused = refusal.short
    except Exception as error:  # a config class that cannot be made without arguments
        message = " ".join(str(error).split())
        refused = f"cannot be built from the config: {type(error).__name__}: {message[:200]}"
    return TypeRow(model_type, families.get(model_type), found, refused, time.perf_counter() - began)


def type_rows(model_types: list[str] | None = None) -> list[TypeRow]:
    families = family_of_type()
    return [type_row(model_type, families) for model_type in model_types or image_text_to_text_types()]


def _millions(count: int) -> str:
    return f"{count / 1e6:,.1f}M"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _roles_cell(found: FoundRoles) -> str:
    return "; ".join(
        f"{role}: {', '.join(f'`{p}`' for p in found.role_prefixes[role])} ({_millions(found.parameters[role])})"
        for role in ROLES
    )


def markdown_table(rows: list[TypeRow]) -> str:
    """The summary line and the table, as docs/results/model-types.md holds them between the markers."""
    import transformers

    kinds = Counter(row.kind for row in rows)
    handled = sum(row.family is not None for row in rows)
    refusals = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()) if kind != "roles found")
    lines = [
        f"transformers {transformers.__version__}: {len(rows)} model types, {handled} of them handled by a "
        f"family module. Roles found: {kinds['roles found']}; refused: {refusals or 'none'}.",
        "",
        "| model type | family module | generic finder | roles (parameters of the default config) | "
        "LoRA targets (language model) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        family = f"family module: {row.family}" if row.family else ""
        if row.refused is None:
            outcome, roles, targets = (
                "roles found",
                _roles_cell(row.found),
                ", ".join(row.found.lora_targets["llm"]),
            )
        else:
            outcome, roles, targets = f"refused: {row.refused}", "", ""
            if row.found is not None:  # unassigned parameters: the roles that were found still say much
                roles = _roles_cell(row.found)
        lines.append(f"| `{row.model_type}` | {family} | {_cell(outcome)} | {_cell(roles)} | {targets} |")
    return "\n".join(lines)


def with_table(document: str, table: str) -> str:
    """`document` with the text between the markers replaced by `table`."""
    if START not in document or END not in document:
        raise ValueError(f"the document has no {START} ... {END} markers")
    head, rest = document.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def table_in(document: str) -> str:
    """The text between the markers (what `with_table` wrote)."""
    return document.split(START, 1)[1].split(END, 1)[0].strip("\n")
