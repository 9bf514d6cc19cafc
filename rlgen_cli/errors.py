"""The one exception type for mistakes a user can fix (bad config, missing file, bad input).

The CLI turns it into one red line and exit code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix; the message says what, why and how."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`UserError` with ``message`` unless ``condition`` holds (the config checks' one form)."""
    if not condition:
        raise UserError(message)
