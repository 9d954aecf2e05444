"""The target engine's step cost alone (no services): what one forward pass of `BatchedBackend`
costs for S sessions of about C cached tokens each, decoding one token (K = 0) or verifying a block
of K + 1, on this machine's CPU or a GPU, with where the time goes (--profile).

    .venv/bin/python benchmarks/engine_step.py [--sessions 1,8,32] [--new 1,6] [--context 200]
        [--device cpu|cuda] [--threads N] [--random-weights CONFIG_JSON] [--forward lean,model]
        [--profile] [--out FILE]

Each case first checks what batching may not change: every session's logits from the batched pass
against the same session run alone (max |difference| and whether every row's argmax agrees).
Then it times warm passes (each pass's tokens are cropped off again, so every pass sees the same
contexts) and prints ms per pass and the ratio to one session's pass of the same size.
--forward names the passes measured side by side, case by case: `lean` (the backend's default for
Llama-family models, specdec_core/engine/lean_pass.py) and `model` (the model's own forward; with packed
linears, once the lean pass agreed its q/k/v and gate/up layers each compute their slice of the
lean pass's fused product, so that pass pays for those products several times over and only says
what the module machinery costs on top of that).
--random-weights builds the model from a config.json with random weights (for a machine without
the model files: step costs depend on the shapes, not the values; the agreement check still holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdec_core.engine.batched_backend import BatchedBackend  # noqa: E402


def load(args) -> torch.nn.Module:
    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(args.random_weights)))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
        return model.to(args.device).eval()
    from specdec_core.engine.models import load_causal_lm
    from specdec_core.engine.options import EngineOptions

    return load_causal_lm(args.model, EngineOptions.from_env(), dtype=args.dtype, device=args.device,
                          int8_inputs=args.int8_inputs)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


WARM_PASSES = 2  # unmeasured passes before case() times its repeats


def case(backend, handles, new: int, repeats: int, device: str, check: bool = True) -> dict:
    """One batched pass of `new` tokens for every handle: agreement with the sessions alone, then ms per pass."""
    g = torch.Generator().manual_seed(new)
    ids = [torch.randint(0, backend.vocab_size, (new,), generator=g).tolist() for _ in handles]

    def step(hs, blocks):
        out = backend.forward_batch([(h, b, h.length) for h, b in zip(hs, blocks)], [new] * len(hs))
        for h in hs:
            backend.crop(h, h.length - new)
        return out

    diff, same_argmax = 0.0, True
    if check:
        batched = step(handles, ids)
        alone = [step([h], [b])[0] for h, b in zip(handles, ids)]
        diff = max((a - b).abs().max().item() for a, b in zip(batched, alone))
        same_argmax = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(batched, alone))
    for _ in range(WARM_PASSES):
        step(handles, ids)
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        step(handles, ids)
    sync(device)
    ms = (time.perf_counter() - t) / repeats * 1e3
    return {"sessions": len(handles), "new_tokens": new, "ms_per_pass": ms,
            "max_abs_diff_vs_alone": diff, "argmax_same_as_alone": same_argmax}


def breakdown(backend, handles, new: int, repeats: int, device: str) -> dict[str, float]:
    """ms per pass in each part of the lean pass, timed around its calls, each part's own time (a
    timed call inside another counts for its own part only); the timers add a little to every part,
    and `total` is the pass under them."""
    from specdec_core.engine.batched_backend import _BatchView
    from specdec_core.engine.cpu_linear import Fused

    lean, spent = backend._lean, {}
    parts = [(Fused, "__call__", "linears"), (Fused, "add", "linears"), (_BatchView, "write_qkv", "pool writes"),
             (_BatchView, "update", "pool writes"), (_BatchView, "attend", "attention"),
             (lean.model.lm_head, "forward", "LM head"), (lean.decoder.norm, "forward", "norms")]
    for layer in lean.layers:
        parts += [(layer.input_layernorm, "forward", "norms"), (layer.post_attention_layernorm, "forward", "norms"),
                  (layer.mlp.act_fn, "forward", "activation")]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in parts]

    open_calls = []  # labels of the timed calls in progress: a call's time is its own part's, not its caller's

    def timed(f, label):
        def call(*a, **k):
            open_calls.append(label)
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                took = time.perf_counter() - t
                open_calls.pop()
                spent[label] = spent.get(label, 0.0) + took
                if open_calls:
                    spent[open_calls[-1]] -= took
        return call

    def put(obj, name, value):  # past nn.Module's __setattr__, which takes only modules for act_fn
        (type.__setattr__ if isinstance(obj, type) else object.__setattr__)(obj, name, value)

    for obj, name, label in parts:
        put(obj, name, timed(getattr(obj, name), label))
    try:
        case(backend, handles, new, 2, device, check=False)
        spent.clear()
        total = case(backend, handles, new, repeats, device, check=False)["ms_per_pass"]
    finally:
        for obj, name, original in reversed(saved):
            if original is not None:
                put(obj, name, original)
            elif name in obj.__dict__:
                object.__delattr__(obj, name)
    ms = {label: t * 1e3 / (repeats + WARM_PASSES) for label, t in spent.items()}  # case()'s warm-up is timed too
    return {"total": total, **ms, "rest": total - sum(ms.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--random-weights", metavar="CONFIG_JSON", help="random weights of this config instead")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--int8-inputs", action="store_true",
                   help="block-quantized linears in llama.cpp's arithmetic (the draft worker's --quantize-inputs)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--sessions", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--new", default="1,6", help="comma-separated tokens per session per pass (1: K = 0)")
    p.add_argument("--context", type=int, default=200, help="cached tokens per session (session i: + 7 i)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--forward", default="lean",
                   help="comma-separated passes to measure side by side: lean, model (default lean)")
    p.add_argument("--profile", action="store_true", help="print the op breakdown of the largest case (first pass named)")
    p.add_argument("--breakdown", action="store_true",
                   help="per case, ms per pass in the lean pass's parts: linears, LM head, attention, pool writes, "
                        "norms, activation, the rest (the CPU kernels are C calls, which --profile does not see)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sessions = [int(s) for s in args.sessions.split(",")]
    news = [int(n) for n in args.new.split(",")]

    model = load(args)
    backend = BatchedBackend(model, max_tokens=max(sessions) * (args.context + 7 * max(sessions) + 512))
    g = torch.Generator().manual_seed(0)
    handles = []
    for i in range(max(sessions)):
        h = backend.allocate()
        backend.forward(h, torch.randint(0, backend.vocab_size, (args.context + 7 * i,), generator=g).tolist(), 0,
                        num_logits=1)
        handles.append(h)
    print(f"device {args.device}, {args.dtype}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}",
          flush=True)
    lean = backend._lean  # checked against the model's own pass at the handles' first forward
    if lean is None:
        print("the lean pass does not apply to this model (or differed from its own forward)", flush=True)
    passes = [f for f in args.forward.split(",") if f == "model" or lean is not None]
    results = []
    for new in news:
        for s in sessions:
            for forward in passes:
                backend._lean = lean if forward == "lean" else None
                r = {"forward": forward, **case(backend, handles[:s], new, args.repeats, args.device)}
                one = next(x for x in results if x["new_tokens"] == new and x["sessions"] == 1
                           and x["forward"] == forward) if s != 1 else r
                r["vs_one_session"] = r["ms_per_pass"] / one["ms_per_pass"]
                if args.breakdown and forward == "lean":
                    r["breakdown_ms"] = breakdown(backend, handles[:s], new, args.repeats, args.device)
                results.append(r)
                print(f"{s:3d} sessions x {new} tokens, {forward:5s} pass: {r['ms_per_pass']:8.2f} ms per pass "
                      f"({r['vs_one_session']:.2f}x one session's); logits vs alone: max |diff| "
                      f"{r['max_abs_diff_vs_alone']:.1e}, argmax {'same' if r['argmax_same_as_alone'] else 'DIFFERENT'}",
                      flush=True)
                if "breakdown_ms" in r:
                    print("      " + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_ms"].items()), flush=True)
    backend._lean = lean if passes and passes[0] == "lean" else None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            case(backend, handles[:max(sessions)], max(news), 3, args.device, check=False)
        key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
                       "context": args.context, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
