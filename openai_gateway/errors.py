"""A request the gateway refuses itself, in OpenAI's terms."""

from __future__ import annotations


class RequestError(Exception):
    """A request OpenAI's API would refuse: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def invalid(param: str, problem: str) -> RequestError:
    return RequestError(400, f"{param}: {problem}", param)
