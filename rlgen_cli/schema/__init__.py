"""Typed config schemas and the checks that run on them before anything loads."""
