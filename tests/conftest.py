"""Shared fixtures: tiny model pairs, a real Redis server, and running stacks.

Expensive things (models, stacks) are built once per session or module and shared."""

from __future__ import annotations

import pytest

from stacks import ReferenceDecoder, start_stack
from tiny_models import make_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """(target folder, draft folder) of a tiny random Llama pair with the SmolLM2 tokenizer."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_pair):
    """The tiny target decoding alone with transformers' generate (the reference for identity)."""
    return ReferenceDecoder(tiny_pair[0])


@pytest.fixture(scope="module")
def tiny_stack(tiny_pair, tmp_path_factory):
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"))
    yield stack
    stack.down()
