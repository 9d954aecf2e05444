"""A transformers causal LM as a `CacheBackend`: one `DynamicCache` per sequence, which grows as it
is fed; its room is counted in tokens (`max_tokens` over all sequences)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec_core.engine.cpu_linear import num_parameters
from specdec_core.engine.kvcache import logits_per_item


class HFBackend:
    name = "transformers"

    def __init__(self, model, max_tokens: int = 65536):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.capacity = int(max_tokens)
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.num_parameters = num_parameters(model)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    def units_for(self, length: int) -> int:
        return length

    def allocate(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def crop(self, handle: DynamicCache, length: int) -> None:
        handle.crop(length - handle.get_seq_length())  # crop() takes minus the tokens to drop

    def free(self, handle: DynamicCache) -> None:
        handle.crop(-handle.get_seq_length())

    @torch.inference_mode()
    def forward(self, handle: DynamicCache, token_ids: list[int], start: int,
                num_logits: int | None = None) -> torch.Tensor:
        assert handle.get_seq_length() == start, (handle.get_seq_length(), start)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, L]
        keep = logits_per_item([(handle, token_ids, start)], None if num_logits is None else [num_logits])[0]
        if keep == 0:  # logits_to_keep=0 means "all"; compute one row and drop it
            self.model(input_ids=input_ids, cache=handle, use_cache=True, logits_to_keep=1)
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        out = self.model(input_ids=input_ids, cache=handle, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()  # [keep, V]
