"""Tiny random Llama-style target/draft pairs, saved with `save_pretrained` so that the services
load them through the same code users run. The draft is the target with its weights perturbed,
so that it agrees with the target often but not always (both accept and reject paths run)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core.engine.models import load_tokenizer
from specdec_core.engine.options import EngineOptions

ENGINE = EngineOptions.from_env()  # what the workers the tests start get from their flags' defaults


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )


def tiny_llama(vocab_size: int = 256, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama in memory (no tokenizer), for tests that drive a backend directly."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def make_tiny_pair(root: Path, seed: int = 0, noise: float = 0.02) -> tuple[str, str]:
    """Write target/ and draft/ folders under root (with the SmolLM2 tokenizer); return their paths."""
    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config(len(tokenizer))).eval()
    with torch.no_grad():
        for p in target.parameters():  # larger weights: peakier, more decisive distributions
            p.mul_(8.0)
    draft = LlamaForCausalLM(tiny_config(len(tokenizer))).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn_like(p) * p.abs().mean())
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        folder = root / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        paths.append(str(folder))
    return paths[0], paths[1]
