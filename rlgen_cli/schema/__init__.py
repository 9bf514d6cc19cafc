"""Typed config schemas, cross-field checks and the user-error type."""

from rlgen_cli.schema.errors import UserError

__all__ = ["UserError"]
