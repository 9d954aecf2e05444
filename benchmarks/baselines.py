"""What others achieve with the same model, run inside the benchmark process, one request at a time:
- transformers `generate`, greedy (the target alone) and with prompt lookup
  (`prompt_lookup_num_tokens`); transformers cannot batch assisted generation, so "serving N
  requests" is N sequential calls;
- llama-cpp-python's `LlamaPromptLookupDecoding` on the Q4_1 GGUF: a quantized model, so its output
  differs from the fp32 target's; a reference point, not a like-for-like comparison.

Each runner takes (prompt index, chat messages, max new tokens) and returns a measure.Request whose
arrival times come from a streamer, exactly like a specdec stream's chunks.
"""

from __future__ import annotations

import os

from measure import Request

PROMPT_LOOKUP_TOKENS = 10  # transformers' and llama.cpp's usual default


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids, encoded as the coordinator does (template, then no special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _Arrivals:
    """A transformers streamer that notes when tokens arrive (the first put is the prompt)."""

    def __init__(self, request: Request):
        self.request = request
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.request.arrive(value.reshape(-1).cpu().tolist())

    def end(self) -> None:
        pass


class HFBaseline:
    """The target model loaded as the target service loads it, driven by transformers' generate."""

    def __init__(self, model_ref: str = "smollm2", device: str = "cpu"):
        import transformers
        from specdec_core.engine.models import load_causal_lm, load_tokenizer
        from specdec_core.engine.options import EngineOptions

        transformers.logging.set_verbosity_error()
        self.device = device
        engine = EngineOptions.from_env()  # as the target service's flags default
        self.tokenizer = load_tokenizer(model_ref, engine.cache_dir)
        self.model = load_causal_lm(model_ref, engine, dtype="float32", device=device)
        self.eos = self.tokenizer.eos_token_id

    def run(self, index: int, messages: list[dict], max_new_tokens: int, lookup: int | None = None) -> Request:
        import torch

        ids = torch.tensor([chat_ids(self.tokenizer, messages)], device=self.device)
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        request = Request(index)
        streamer = _Arrivals(request)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos,
                                      streamer=streamer, **extra)
        request.finish()
        request.token_ids = out[0, ids.shape[1]:].tolist()  # the truth; the streamer only gave times
        return request

    def greedy(self, index: int, messages: list[dict], max_new_tokens: int) -> Request:
        return self.run(index, messages, max_new_tokens)

    def prompt_lookup(self, index: int, messages: list[dict], max_new_tokens: int) -> Request:
        return self.run(index, messages, max_new_tokens, lookup=PROMPT_LOOKUP_TOKENS)


class LlamaPromptLookup:
    """llama-cpp-python's high-level Llama with its prompt-lookup draft, greedy, prompt cache off."""

    def __init__(self, tokenizer, gguf: str | None = None, n_ctx: int = 4096):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        from specdec_core.engine.models import embedded_gguf_path

        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        threads = os.cpu_count() or 1  # the draft service's default too (Llama's own is half the cores)
        # n_batch = n_ctx: with a draft model llama-cpp-python keeps the logits of every evaluated
        # token in a scores buffer of n_batch rows, which overflows past n_batch tokens otherwise
        self.llm = Llama(model_path=str(gguf or embedded_gguf_path()), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                         n_threads_batch=threads, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS))

    def run(self, index: int, messages: list[dict], max_new_tokens: int) -> Request:
        ids = chat_ids(self.tokenizer, messages)
        self.llm.reset()  # no prompt-prefix reuse across requests: nobody else gets it either
        request = Request(index)
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            request.arrive([token])
            if token == self.eos or len(request.token_ids) >= max_new_tokens:
                break
        return request.finish()
