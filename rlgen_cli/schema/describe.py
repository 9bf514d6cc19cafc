"""Every setting of a schema as a row: its key, type, default, valid values and docstring.

The schema is the one source: a field's docstring is the string literal written below it in its class
(read back from the source, as Python keeps no attribute docstrings), its valid values come from
``schema/ranges.py`` (numbers) and its ``Annotated`` choice (``schema/choices.py``), its default from the
dataclass. ``rlgen ls --keys`` prints the rows and docs/settings.md is generated from them
(``tasks/ls.py``), so neither is a copy that can fall behind.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from rlgen_cli.schema.check import CheckSection
from rlgen_cli.schema.choices import choices_of
from rlgen_cli.schema.plan import PlanSection
from rlgen_cli.schema.r3 import R3PolicySection
from rlgen_cli.schema.ranges import range_of
from rlgen_cli.schema.recipes import FREE_FORM, TRAIN_SCHEMAS
from rlgen_cli.schema.serve import ServeRewardConfig
from rlgen_cli.schema.variants import section_variants, variant_name

__all__ = [
    "DEFAULT_RECIPE",
    "TOP_LEVEL",
    "VERB_SECTIONS",
    "KeyRow",
    "field_docs",
    "group_names",
    "group_rows",
    "key_rows",
    "sections_of",
]

DEFAULT_RECIPE = "flow_grpo"
"""The recipe ``rlgen train`` composes when no ``algo`` or ``model`` option picks another (conf/train.yaml)."""
TOP_LEVEL = "run"
"""The name the keys at the root of a config (``seed``, ``epochs``, …) are listed under."""
VERB_SECTIONS: dict[str, tuple[type, str]] = {
    "check": (CheckSection, "rlgen check-onpolicy"),
    "plan": (PlanSection, "rlgen plan"),
    "server": (ServeRewardConfig, "rlgen serve-reward"),
}
"""Sections a verb other than ``rlgen train`` adds: name → (the schema declaring it, the verb)."""


@dataclass(frozen=True)
class KeyRow:
    """One setting (or, with ``type == "section"``, a nested section and its docstring)."""

    key: str
    type: str
    default: str
    valid: str
    doc: str

    @property
    def is_section(self) -> bool:
        return self.type == "section"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring written below it} of ``cls`` and its bases (the nearest class wins);
    classes built at run time (``make_dataclass``) have no source and add nothing."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    if not isinstance(body, ast.ClassDef):
        return {}
    docs = {}
    for stmt, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _inner_dataclass(hint: Any) -> type | None:
    """The schema dataclass a field holds (``X`` or ``X | None``), else None."""
    inner = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
    if typing.get_origin(hint) is Annotated:
        return None
    held = inner[0] if len(inner) == 1 else None
    return held if isinstance(held, type) and dataclasses.is_dataclass(held) else None


def type_name(hint: Any) -> str:
    """A field's type as a config user reads it: ``int``, ``float | null``, ``list[str]``, ``dict[str, float]``."""
    if typing.get_origin(hint) is Annotated:
        return type_name(typing.get_args(hint)[0])
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))


def format_value(value: Any) -> str:
    """A default as it would be written in YAML: ``null``, ``true``, ``""``, ``[a, b]``, ``{}``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return str(value) if math.isfinite(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | tuple):
        return f"[{', '.join(format_value(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _valid(schema: type, name: str, hint: Any) -> str:
    """The field's valid values in words: its choices or its range (of each element for lists and maps)."""
    choices = choices_of(schema, name)
    if choices is not None:
        return " | ".join(format_value(c) for c in choices)
    rule = range_of(schema, name)
    if rule is None:
        return ""
    each = typing.get_origin(_without_none(hint)) in (list, dict)
    return f"each {rule.describe()}" if each else rule.describe()


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


def _default_of(f: dataclasses.Field, instance: Any) -> Any:
    """The field's value in ``instance`` (a section built by its parent's factory), else its own default."""
    if instance is not None and hasattr(instance, f.name):  # a section default of another schema lacks some
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return _built(f.default_factory)
    return dataclasses.MISSING


def _built(factory: Any) -> Any:
    """``factory()``, or None when the section it builds refuses its own defaults (``ModelConfig()`` has no
    ``path``): its fields' defaults are then read from the class."""
    try:
        return factory()
    except Exception:  # a section whose __post_init__ needs a value a config option provides
        return None


def key_rows(schema: type, prefix: str = "", instance: Any = None) -> list[KeyRow]:
    """Every setting of ``schema`` in declaration order, nested sections followed (a section row first,
    when the section is documented); the maps of ``FREE_FORM`` are settings, not sections."""
    hints = typing.get_type_hints(schema, include_extras=True)
    docs = field_docs(schema)
    rows = []
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        section = _inner_dataclass(hint)
        default = _default_of(f, instance)
        if section is not None and key not in FREE_FORM:
            doc = docs.get(f.name) or inspect.cleandoc(section.__doc__ or "")
            if doc and not doc.startswith(f"{section.__name__}("):  # dataclass's generated signature
                rows.append(KeyRow(f"{key}.*", "section", "", "", doc))
            instance_of_section = default if dataclasses.is_dataclass(default) else None
            if len(section_variants(section)) > 1:  # its keys are those of the option that picks it
                rows.extend(_variant_rows(section, f"{key}.", instance_of_section))
                continue
            rows.extend(key_rows(section, f"{key}.", instance_of_section))
            continue
        shown = "required" if default is dataclasses.MISSING else format_value(default)
        rows.append(KeyRow(key, type_name(hint), shown, _valid(schema, f.name, hint), docs.get(f.name, "")))
    return rows


def _variant_rows(section: type, prefix: str, instance: Any = None) -> list[KeyRow]:
    """The rows of every schema ``section`` can be composed as (each family's, each R3 policy's), each key
    once; a key only some of them have says which (``Only model.family=wan2_1, wan2_2, wan2_2_i2v.``)."""
    schemas = section_variants(section)
    family = getattr(instance, "family", None)  # the default's own family first, its values as defaults
    schemas.sort(key=lambda v: variant_name(v) != family)
    variants = {variant_name(v): key_rows(v, prefix, instance) for v in schemas}
    chosen_by = "model.family" if issubclass(section, R3PolicySection) else f"{prefix}family"
    having: dict[str, list[str]] = {}
    first: dict[str, KeyRow] = {}
    for name, rows in variants.items():
        for row in rows:
            first.setdefault(row.key, row)
            having.setdefault(row.key, []).append(name)
    out = []
    for key, row in first.items():
        names = having[key]
        if len(names) < len(variants) and not row.is_section:
            row = dataclasses.replace(row, doc=f"{row.doc} Only {chosen_by}={', '.join(names)}.".strip())
        out.append(row)
    return out


def sections_of(schema: type) -> list[str]:
    """The top-level sections of ``schema`` (``model``, ``algo``, …), in declaration order."""
    hints = typing.get_type_hints(schema, include_extras=True)
    return [
        f.name
        for f in dataclasses.fields(schema)
        if f.name not in FREE_FORM and _inner_dataclass(hints[f.name]) is not None
    ]


def group_names(recipe: str) -> list[str]:
    """What ``rlgen ls --keys GROUP`` takes for ``recipe``: ``run`` (the top-level keys), the recipe's
    sections and the sections of the other verbs."""
    return [TOP_LEVEL, *sections_of(TRAIN_SCHEMAS[recipe]), *VERB_SECTIONS]


def group_rows(recipe: str, group: str) -> list[KeyRow]:
    """The rows of ``group`` (a name of :func:`group_names`, a nested section such as ``model.lora``, or
    one key) for ``recipe``, its own section row (``group.*``, when documented) first; empty when the recipe has no
    such group."""
    schema, head = TRAIN_SCHEMAS[recipe], group.split(".", 1)[0]
    if head in VERB_SECTIONS:
        schema = VERB_SECTIONS[head][0]
    rows = key_rows(schema)
    if group == TOP_LEVEL:
        return [r for r in rows if "." not in r.key]
    return [r for r in rows if r.key == group or r.key.startswith(f"{group}.")]
