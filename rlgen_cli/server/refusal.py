"""How a request handler refuses: :class:`ApiError` (answered as JSON with its status) and
:class:`ClientDisconnected` (nothing to answer)."""

from __future__ import annotations

from rlgen_cli.rewards.remote import wire

__all__ = ["ApiError", "ClientDisconnected", "wire_error"]


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the problem, a metrics ``kind``;
    ``close`` ends the connection after the reply (its framing can no longer be trusted); ``headers``
    are added to the reply (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "validation",
        close: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.close = status, message, kind, close
        self.headers = headers or {}


class ClientDisconnected(Exception):
    """The client hung up before its whole request body arrived: nothing to answer, nothing broken."""


def wire_error(err: wire.WireError) -> ApiError:
    """The refusal of a request the wire format rejected, with its status (413, counted as
    ``too_large``, for a size)."""
    return ApiError(err.status, str(err), "too_large" if err.status == 413 else "validation")
