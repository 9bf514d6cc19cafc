"""The schemas a model section can be composed as: a section declared with a kind's schema (flow, VLM, R3's
policy) is composed as the schema of the family its option picks, and the commands that list keys
(``rlgen ls --keys``, the composed-keys test) read every one of them."""

from __future__ import annotations

from rlgen_cli.schema.model import FAMILY_SCHEMAS
from rlgen_cli.schema.r3 import R3_POLICY_SCHEMAS


def section_variants(section: type) -> list[type]:
    """The schemas a section declared as ``section`` can be composed as: the family schemas (and R3's
    policies) that extend it when an option picks them, else ``section`` itself."""
    picked = [*FAMILY_SCHEMAS.values(), *R3_POLICY_SCHEMAS.values()]
    variants = [schema for schema in picked if issubclass(schema, section)]
    return variants or [section]


def variant_name(schema: type) -> str:
    """The ``model.family`` whose schema (or R3 policy schema) ``schema`` is."""
    named = {
        **{cls: name for name, cls in FAMILY_SCHEMAS.items()},
        **{cls: n for n, cls in R3_POLICY_SCHEMAS.items()},
    }
    return named.get(schema, schema.__name__)
