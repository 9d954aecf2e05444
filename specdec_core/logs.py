"""Logging: plain text or one JSON object per line, carrying the request id and the session digest
of the call being served (set with `log_context`). Prompt text is never logged at INFO or above,
session ids never at all (`short_id`)."""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import time
from contextlib import contextmanager

_context: contextvars.ContextVar[dict] = contextvars.ContextVar("specdec_log_context", default={})


@contextmanager
def log_context(**fields):
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _context.reset(token)


def short_id(session_id: str) -> str:
    """A session's name in logs and error messages: a short digest. The id itself is a bearer
    capability (whoever holds it, and is of its tenant, can read and continue the session), so it
    is never logged."""
    return "s:" + hashlib.blake2b(session_id.encode(), digest_size=6).hexdigest()


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = _context.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "ctx", {}),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = getattr(record, "ctx", {})
        return line + "".join(f" {k}={v}" for k, v in ctx.items())


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
