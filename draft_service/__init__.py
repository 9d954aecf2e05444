"""The draft worker: a cheap model proposing blocks of tokens, with per-session KV caches."""
