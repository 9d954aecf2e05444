"""The coordinator: public API, tokenizer and chat template, the speculative loop, stop
conditions, streaming, and session state in Redis. It holds no model weights and no state of its
own: any replica can continue any session."""
