"""Input limits that the coordinator and the workers share."""

from __future__ import annotations

import re

from specdec_core.errors import InvalidArgument

MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_SESSION_ID_CHARS}}}")  # the store makes uuid4 hex ids


MAX_DECODE_STEPS = 64  # plain decoding steps one Verify call may take after its verdict
MAX_HEAD_TOKENS = 16  # draft tokens a target worker's head proposes in one Verify call
MAX_SPECULATIVE_TOKENS = 32  # draft tokens a round may verify (K)

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def validate_request_id(request_id: str) -> None:
    """INVALID_ARGUMENT naming `request_id` unless it is 1..128 characters of [A-Za-z0-9._:-]."""
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument(
            "request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'")


def validate_session_id(session_id: str) -> None:
    """INVALID_ARGUMENT naming `session_id` unless it is 1..128 characters of [A-Za-z0-9_-]."""
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(
            "session_id", f"must be 1 to {MAX_SESSION_ID_CHARS} characters of A-Z, a-z, 0-9, '_' or '-'")


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """INVALID_ARGUMENT naming `name` if any id lies outside the vocabulary [0, vocab_size)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(name, f"token id {bad} outside the vocabulary [0, {vocab_size})")
