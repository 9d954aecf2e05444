"""Helpers the tests share: a reference decoder (the target alone, with transformers' generate)
and starting a stack whose logs are printed when it fails to come up."""

from __future__ import annotations

from specdec.launcher import Stack


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
