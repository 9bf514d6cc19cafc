"""The one exception type for mistakes a user can fix (bad config, missing file, bad input).

The CLI turns it into one red line and exit code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix; the message says what, why and how."""
