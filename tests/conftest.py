"""Shared fixtures: tiny model pairs, a real Redis server, and running stacks.

Expensive things (models, stacks) are built once per session or module and shared."""

from __future__ import annotations

import pytest

from specdec.launcher import Stack
from tiny_models import make_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """(target folder, draft folder) of a tiny random Llama pair with the SmolLM2 tokenizer."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_pair):
    """The tiny target decoding alone with transformers' generate (the reference for identity)."""
    return ReferenceDecoder(tiny_pair[0])


class ReferenceDecoder:
    def __init__(self, model_ref: str):
        from specdec_core.models import load_causal_lm

        self.model = load_causal_lm(model_ref)

    def __call__(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        with torch.inference_mode():
            out = self.model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones(1, len(input_ids), dtype=torch.long))
        return out[0, len(input_ids):].tolist()


def start_stack(target: str, draft: str, log_dir, **kwargs) -> Stack:
    stack = Stack(target_model=target, draft_model=draft, log_dir=log_dir, **kwargs)
    try:
        stack.up(wait_s=300)
    except BaseException:
        stack.down()
        for log in log_dir.glob("*.log"):
            print(f"==== {log.name}\n{log.read_text()[-3000:]}")
        raise
    return stack


@pytest.fixture(scope="module")
def tiny_stack(tiny_pair, tmp_path_factory):
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"))
    yield stack
    stack.down()
