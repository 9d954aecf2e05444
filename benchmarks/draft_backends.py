"""The draft worker's backends side by side on the embedded default (SmolLM2-135M-Instruct Q4_1 GGUF),
in one process, no services: what a draft step costs and how often the draft's greedy choice is
the target's.

    .venv/bin/python benchmarks/draft_backends.py [--prompts 8] [--tokens 64] [--sessions 1,8]
        [--threads 1,2] [--out benchmarks/results/int8_draft]

Backends: llama.cpp (the GGUF), and this project's engine (`BatchedBackend`, the model the target
loads) with the linears in llama.cpp's arithmetic (`--quantize-inputs`, 8-bit inputs, integer
sums) and in float32 (what the target computes: its cost is the target's own step).
- agreement: the chat prompts' greedy continuations by the float32 target (`--tokens` each), fed to
  each draft teacher-forced; the fraction of positions where the draft's argmax is the target's
  next token (what greedy acceptance per draft token approaches).
- step cost: S sessions (the chat prompts, and the start of their continuations) decode one token
  each per batched pass, ms per pass, warm, at each thread count (each pass's tokens are cropped off
  again, so every pass sees the same contexts).
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from baselines import chat_ids  # noqa: E402
from prompts import take  # noqa: E402
from specdec_core.engine import cpu_kernels, cpu_quantized  # noqa: E402
from specdec_core.engine.batched_backend import BatchedBackend  # noqa: E402
from specdec_core.engine.models import gguf_path, load_causal_lm, load_tokenizer  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402

REPEATS = 20


def continuations(target: BatchedBackend, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The float32 target's greedy continuation of every prompt (one session at a time)."""
    out = []
    for ids in prompts:
        h = target.allocate()
        logits = target.forward(h, ids, 0, 1)
        new = [int(logits[-1].argmax())]
        while len(new) < tokens:
            new.append(int(target.forward(h, new[-1:], len(ids) + len(new) - 1, 1)[-1].argmax()))
        target.free(h)
        out.append(new)
    return out


def agreement(backend, prompts: list[list[int]], conts: list[list[int]]) -> float:
    same = total = 0
    for ids, cont in zip(prompts, conts):
        h = backend.allocate()
        logits = backend.forward(h, ids + cont[:-1], 0, len(cont))
        same += sum(int(a) == b for a, b in zip(logits.argmax(-1).tolist(), cont))
        total += len(cont)
        backend.free(h)
    return same / total


def step_ms(backend, prompts: list[list[int]], conts: list[list[int]], sessions: int) -> float:
    contexts = [(prompts[i % len(prompts)] + conts[i % len(prompts)])[:-1] for i in range(sessions)]
    nxt = [conts[i % len(prompts)][-1] for i in range(sessions)]
    handles = [backend.allocate() for _ in contexts]
    for h, c in zip(handles, contexts):
        backend.forward(h, c, 0, 1)

    def step():
        backend.forward_batch([(h, [t], len(c)) for h, t, c in zip(handles, nxt, contexts)], [1] * sessions)
        for h, c in zip(handles, contexts):
            backend.crop(h, len(c))

    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(REPEATS):
        step()
    ms = (time.perf_counter() - t) / REPEATS * 1e3
    for h in handles:
        backend.free(h)
    return ms


def llama_backend(threads: int):
    from draft_service.llama_backend import LlamaCppBackend

    return LlamaCppBackend(str(gguf_path("smollm2")), n_ctx=2048, max_sequences=16, n_threads=threads)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="greedy target tokens per prompt")
    p.add_argument("--sessions", default="1,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--out", default=str(HERE / "results" / "int8_draft"))
    a = p.parse_args(argv)
    sessions = [int(x) for x in a.sessions.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    options = EngineOptions.from_env()  # as the workers' flags default
    tokenizer = load_tokenizer("smollm2", options.cache_dir)
    prompts = [chat_ids(tokenizer, m) for m in take("chat", a.prompts)]
    print(f"target continuations: {a.prompts} chat prompts x {a.tokens} tokens ...", flush=True)
    target = BatchedBackend(load_causal_lm("smollm2", options))
    conts = continuations(target, prompts, a.tokens)
    backends = {"llama.cpp": lambda t: llama_backend(t),
                "engine, 8-bit inputs": lambda t: engine(True),
                "engine, float32 (the target's)": lambda t: engine(False)}
    if cpu_kernels.load(options) is None or not cpu_quantized.int8_available():
        del backends["engine, 8-bit inputs"]
        print("this CPU has no int8-input kernel (AVX-512 VNNI): that row is left out")
    models: dict[bool, BatchedBackend] = {False: target}

    def engine(int8: bool) -> BatchedBackend:
        if int8 not in models:
            models[int8] = BatchedBackend(load_causal_lm("smollm2", options, int8_inputs=int8))
        return models[int8]

    rows = []
    for name, make in backends.items():
        for t in threads:
            torch.set_num_threads(t)
            backend = make(t)
            row = {"backend": name, "threads": t, "agreement": agreement(backend, prompts, conts)}
            for s in sessions:
                row[f"ms_per_step_{s}"] = step_ms(backend, prompts, conts, s)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if name == "llama.cpp":
                backend.close()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(), "torch": torch.__version__,
            "prompts": a.prompts, "tokens": a.tokens, "command": "benchmarks/draft_backends.py " + " ".join(sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Draft backends side by side ({meta['date']}, {meta['cpus']} CPUs, one process, no services)", "",
             f"Command: `{meta['command']}`. Agreement: the draft's greedy choice = the float32 target's next token, "
             f"teacher-forced over {a.prompts} chat prompts x {a.tokens} target tokens. ms per step: S sessions "
             "decoding one token each in one batched pass, warm.", "",
             "| backend | threads | agreement | " + " | ".join(f"ms/step, {s} session{'s' * (s > 1)}" for s in sessions)
             + " |", "|---|---|---|" + "---|" * len(sessions)]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['threads']} | {r['agreement']:.3f} | "
                     + " | ".join(f"{r[f'ms_per_step_{s}']:.1f}" for s in sessions) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
