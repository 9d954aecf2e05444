"""Grammar libraries for structured outputs on the SmolLM2 vocabulary (49,152 tokens): llguidance,
xgrammar and outlines-core side by side in one process (one that does not import is skipped).

Per library: tokenizer info built from the embedded model's HF tokenizer (`setup`); each grammar's
compile (caches off), a new matcher from it, and its first mask; a matcher walking a valid output
(the model's own tokenization), filling a preallocated int32 bitmask before each token and then
taking it: the first walk on a compiled grammar (cold) apart from later ones (llguidance builds its
lexer lazily and its deep copies share it), median and p99 over tokens, first mask left out;
applying a [6, 49152] bitmask to float32 logits with the library's CPU helper (eager torch for
reference); rollback, how many of 8 draft tokens the grammar takes (the 6th is EOS, invalid there),
and a new matcher taking 200 committed tokens; wheel and installed sizes, declared dependencies.

Keep the libraries out of the project's venv (xgrammar declares triton), e.g.:
    .venv/bin/pip install --no-deps --target /tmp/glibs llguidance xgrammar outlines-core apache-tvm-ffi
    PYTHONPATH=/tmp/glibs .venv/bin/python benchmarks/grammar_libraries.py [--repeats 10]

Writes benchmarks/results/grammar_libraries.json. Times in microseconds, medians of --repeats.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec_core.engine.models import load_tokenizer  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "grammar_libraries.json"
S, I, B, N = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number", "minimum": 0}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


def arr(items: dict) -> dict:
    return {"type": "array", "items": items}


ADDRESS = obj({"street": S, "city": S, "zip": S})
ITEM = obj({"sku": S, "qty": I, "tags": arr(S)})
WEATHER = obj({"name": {"const": "get_weather"}, "arguments": obj(
    {"location": S, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {**I, "minimum": 1, "maximum": 14}},
    ["location", "unit"])})
SEARCH = obj({"name": {"const": "search_web"}, "arguments": obj({"query": S, "max_results": I, "sites": arr(S)},
                                                                ["query"])})
EXPR = "(12+3.5)*4-(7/2+(8-1)*3)"
CFG = {"lark": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
               'factor: NUMBER | "(" expr ")" | "-" factor\nNUMBER: /[0-9]+(\\.[0-9]+)?/\n',
       "ebnf": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
               'factor ::= number | "(" expr ")" | "-" factor\nnumber ::= [0-9]+ ("." [0-9]+)?\n'}
# name: (kind, spec, a valid output); JSON outputs are json.dumps'ed (", " and ": " separators)
CASES = {
    "flat": ("json", obj({"name": S, "age": I, "email": S, "city": S, "active": B, "bio": S}),
             {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "city": "London", "active": True,
              "bio": "Mathematician who wrote the first published algorithm for Babbage's Analytical Engine."}),
    "nested": ("json", obj({"user": obj({"id": I, "name": S, "address": ADDRESS}), "orders": arr(ITEM)}),
               {"user": {"id": 4021, "name": "Grace Hopper", "address": {"street": "12 Navy Way",
                "city": "Arlington", "zip": "22201"}}, "orders": [{"sku": "COBOL-1959", "qty": 2,
                "tags": ["books", "history"]}, {"sku": "UNIVAC-I", "qty": 1, "tags": ["hardware", "vintage"]}]}),
    "enums_numbers": ("json", obj({"status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                                   "priority": {**I, "minimum": 1, "maximum": 5}, "score": {**N, "maximum": 1},
                                   "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "amount": N,
                                   "ratings": arr({**I, "minimum": 0, "maximum": 10})}),
                      {"status": "shipped", "priority": 4, "score": 0.875, "currency": "EUR", "amount": 1249.5,
                       "ratings": [7, 9, 10, 3, 8, 6, 9, 10, 2, 5, 8, 7]}),
    "optional": ("json", obj({"title": S, "subtitle": S, "year": I, "authors": arr(S), "isbn": S, "pages": I},
                             ["title"]),
                 {"title": "Structure and Interpretation of Computer Programs", "year": 1985,
                  "authors": ["Harold Abelson", "Gerald Jay Sussman", "Julie Sussman"], "pages": 657}),
    "tool_call": ("json", {"anyOf": [WEATHER, SEARCH]},
                  {"name": "search_web", "arguments": {"query": "speculative decoding with grammar constraints",
                   "max_results": 10, "sites": ["arxiv.org", "github.com", "huggingface.co"]}}),
    "json_object": ("json", {"type": "object"},
                    {"id": "req-7f3a", "ok": True, "latency_ms": 12.75, "tags": ["a", "b", None],
                     "meta": {"region": "eu-west-1", "retries": 2, "nodes": ["n1", "n2", "n3"],
                              "load": [0.42, 0.17, 0.08]}, "note": "nested 3 deep: outlines-core's regex stops there"}),
    "regex_datetime": ("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(Z|[+-][0-9]{2}:[0-9]{2})",
                       "2026-12-07T18:22:05+01:00"),
    "choice": ("choice", ["positive", "negative", "neutral", "mixed"], "neutral"),
    "cfg_arith": ("cfg", CFG, "+".join([EXPR] * 4)),
}
NESTED_LONG = {**CASES["nested"][2], "orders": CASES["nested"][2]["orders"] * 3}  # 200+ tokens: rebuild


class Unsupported(Exception):
    """A grammar kind the library has no way to express."""


@dataclass(frozen=True)
class Library:
    """One library's calls; m is a matcher, ids token ids, b an int32 bitmask [rows, words]."""
    dist: str
    setup: Callable[[Any], Any]  # HF tokenizer -> what compile takes (tokenizer info, or a compiler)
    compile: Callable[[Any, str, Any], Any]  # (setup's result, kind, spec) -> compiled grammar
    fresh: Callable[[Any], Any]  # compiled grammar -> a new matcher
    fill: Callable[[Any, torch.Tensor], None]
    consume: Callable[[Any, list[int]], bool]
    rollback: Callable[[Any, int], None]
    count_valid: Callable[[Any, list[int]], int]  # how many draft tokens it would take, state unchanged
    accepting: Callable[[Any], bool]
    take_eos: Callable[[Any, int], bool]  # consume EOS: True if taken and the matcher is then done
    apply: Callable[[torch.Tensor, torch.Tensor], None]  # logits [rows, vocab], b


def stepwise_count(step: Callable[[Any, int], bool], undo: Callable[[Any, int], None]):
    """count_valid for a library without one: take tokens one by one, then roll back as many."""
    def count(m, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and step(m, ids[n]):
            n += 1
        undo(m, n)
        return n
    return count


def llguidance_api() -> Library:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    M = llguidance.LLMatcher

    def compile_(info, kind: str, spec):
        grammar = {"json": lambda: M.grammar_from_json_schema(spec), "regex": lambda: M.grammar_from_regex(spec),
                   "choice": lambda: M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec)),
                   "cfg": lambda: M.grammar_from_lark(spec["lark"])}[kind]()
        matcher = M(info, grammar, log_level=0)  # compiles; a request deep_copy()s this pristine one
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    return Library("llguidance", llguidance.hf.from_tokenizer, compile_, lambda c: c.deep_copy(),
                   lt.fill_next_token_bitmask, lambda m, ids: m.consume_tokens(ids), lambda m, n: m.rollback(n),
                   lambda m, ids: m.validate_tokens(ids), lambda m: m.is_accepting(),
                   lambda m, eos: m.consume_token(eos) and m.is_stopped(), lt.apply_token_bitmask_inplace)


def xgrammar_api() -> Library:
    import xgrammar as xgr

    def setup(tok):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        return xgr.GrammarCompiler(info, max_threads=os.cpu_count(), cache_enabled=False)

    def compile_(c, kind: str, spec):
        return {"json": lambda: c.compile_json_schema(json.dumps(spec)), "regex": lambda: c.compile_regex(spec),
                "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec)),
                "cfg": lambda: c.compile_grammar(spec["ebnf"])}[kind]()

    return Library("xgrammar", setup, compile_, xgr.GrammarMatcher, lambda m, b: m.fill_next_token_bitmask(b),
                   lambda m, ids: all(m.accept_token(t) for t in ids), lambda m, n: m.rollback(n),
                   stepwise_count(lambda m, t: m.accept_token(t), lambda m, n: m.rollback(n)),
                   lambda m: m.is_completed(), lambda m, eos: m.accept_token(eos) and m.is_terminated(),
                   xgr.apply_token_bitmask_inplace)


def outlines_core_api() -> Library:
    import outlines_core as oc
    import outlines_core.kernels.torch as ot
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    def setup(tok):
        """A Vocabulary of token bytes (undoing byte-level BPE's byte-to-unicode map), special tokens
        left out, EOS given apart."""
        byte_of = {u: b for b, u in bytes_to_unicode().items()}
        special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
        vocab: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i not in special:
                vocab.setdefault(bytes(byte_of[c] for c in text), []).append(i)
        return oc.Vocabulary(tok.eos_token_id, vocab)

    def compile_(vocab, kind: str, spec):
        if kind == "cfg":
            raise Unsupported("no context-free grammars (regular languages only: regex, JSON schema)")
        regex = {"json": lambda: oc.json_schema.build_regex_from_schema(json.dumps(spec)), "regex": lambda: spec,
                 "choice": lambda: "(" + "|".join(re.escape(s) for s in spec) + ")"}[kind]()
        return oc.Index(regex, vocab)

    def consume(g, ids: list[int]) -> bool:
        try:
            for t in ids:
                g.advance(t, return_tokens=False)  # raises ValueError on a token the grammar refuses
            return True
        except ValueError:
            return False

    return Library("outlines_core", setup, compile_, oc.Guide,
                   lambda g, b: g.write_mask_into(b.data_ptr(), b.numel(), b.element_size()), consume,
                   lambda g, n: g.rollback_state(n),
                   stepwise_count(lambda g, t: consume(g, [t]), lambda g, n: g.rollback_state(n)),
                   lambda g: g.is_finished(), lambda g, eos: consume(g, [eos]) and g.is_finished(),
                   ot.apply_token_bitmask_inplace)


LIBRARIES = {"llguidance": llguidance_api, "xgrammar": xgrammar_api, "outlines-core": outlines_core_api}


def us(seconds: list[float]) -> float:
    return round(float(np.median(seconds)) * 1e6, 1)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median microseconds of `repeats` calls, and the last call's result."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return us(times), out


def has_bit(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def walk(lib: Library, compiled, ids: list[int], eos: int, words: int) -> dict:
    """A fresh matcher through `ids`: fill and consume times (s), and whether the grammar agreed."""
    m, bitmask = lib.fresh(compiled), torch.zeros((1, words), dtype=torch.int32)
    fills, consumes, valid = [], [], True
    for t in ids:
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        t1 = time.perf_counter()
        taken = lib.consume(m, [t])
        consumes.append(time.perf_counter() - t1)
        fills.append(t1 - t0)
        valid &= taken and has_bit(bitmask, t)
    lib.fill(m, bitmask)
    return {"fills": fills, "consumes": consumes, "valid": valid, "accepting": lib.accepting(m),
            "eos_allowed": has_bit(bitmask, eos), "eos_consumed": lib.take_eos(m, eos)}


def p50_p99(seconds: list[float]) -> dict | None:
    return {"p50": us(seconds), "p99": round(float(np.percentile(seconds, 99)) * 1e6, 1)} if seconds else None


def grammars(lib: Library, info, tok, repeats: int) -> dict:
    words, eos, out = (len(tok) + 31) // 32, tok.eos_token_id, {}
    walk(lib, lib.compile(info, "regex", "[0-9]"), [], eos, words)  # once a process: first masks ever
    for name, (kind, spec, instance) in CASES.items():
        ids = tok.encode(instance if isinstance(instance, str) else json.dumps(instance), add_special_tokens=False)
        compiled: list = []
        try:
            compile_us, _ = timed(lambda: compiled.append(lib.compile(info, kind, spec)), repeats)
        except Unsupported as e:
            out[name] = {"unsupported": str(e)}
            continue
        cold = [walk(lib, c, ids, eos, words) for c in compiled]  # each compiled grammar's first walk
        warm = [walk(lib, compiled[-1], ids, eos, words) for _ in range(repeats)]
        walks = cold + warm
        out[name] = {"tokens": len(ids), "compile_us": compile_us, "first_mask_us": us([w["fills"][0] for w in cold]),
                     "new_matcher_us": timed(lambda: lib.fresh(compiled[-1]), repeats)[0],
                     "fill_us_cold": p50_p99([s for w in cold for s in w["fills"][1:]]),
                     "fill_us": p50_p99([s for w in warm for s in w["fills"][1:]]),
                     "consume_us_p50": us([s for w in walks for s in w["consumes"]]),
                     **{k: all(w[k] for w in walks) for k in ("valid", "accepting", "eos_allowed", "eos_consumed")}}
        print(f"  {name}: compile {compile_us / 1000:.1f} ms, fill {out[name]['fill_us']}, cold "
              f"{out[name]['fill_us_cold']}, valid {out[name]['valid']}", file=sys.stderr)
    return out


def speculation(lib: Library, info, tok, repeats: int) -> dict:
    """On the tool-call schema: roll back 10 tokens; count the valid prefix of an 8-token draft whose
    6th token is EOS (invalid mid-object). On the nested schema: a fresh matcher takes 200 tokens."""
    words, eos = (len(tok) + 31) // 32, tok.eos_token_id
    kind, spec, instance = CASES["tool_call"]
    ids = tok.encode(json.dumps(instance), add_special_tokens=False)
    m, before, after = lib.fresh(lib.compile(info, kind, spec)), *torch.zeros((2, 1, words), dtype=torch.int32)
    lib.consume(m, ids[:15])
    lib.fill(m, before)
    rollback = []
    for _ in range(repeats):
        lib.consume(m, ids[15:25])
        t = time.perf_counter()
        lib.rollback(m, 10)
        rollback.append(time.perf_counter() - t)
    lib.fill(m, after)
    draft = ids[15:20] + [eos] + ids[21:23]
    count_us, accepted = timed(lambda: lib.count_valid(m, draft), repeats)
    compiled = lib.compile(info, *CASES["nested"][:2])
    long_ids = tok.encode(json.dumps(NESTED_LONG), add_special_tokens=False)
    rebuild_us, rebuilt = timed(lambda: lib.consume(lib.fresh(compiled), long_ids[:200]), repeats)
    return {"rollback_10_us": us(rollback), "same_mask_after_rollback": bool(torch.equal(before, after)),
            "draft_accepted": accepted, "draft_expected": 5, "count_valid_8_us": count_us,
            "rebuild_200_us": rebuild_us, "rebuild_ok": bool(rebuilt) and len(long_ids) >= 200}


def apply_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, words, 32]
    logits.masked_fill_(bits.view(bitmask.shape[0], -1)[:, :logits.shape[1]] == 0, float("-inf"))


def apply_cost(fn: Callable[[torch.Tensor, torch.Tensor], None], vocab: int, repeats: int) -> dict:
    """Masking [6, vocab] float32 logits, fresh ones each call (copied in untimed): the first call
    (torch.compile's, for some), then the median with a mask that allows 64 tokens (a JSON structural
    state) and with a random one (half allowed)."""
    gen, words, out = torch.Generator().manual_seed(0), (vocab + 31) // 32, {}
    for name, bitmask in (("few_allowed", torch.zeros((6, words), dtype=torch.int32)),
                          ("random", torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=gen))):
        bitmask[:, :2] = -1
        fresh, logits = torch.randn(6, vocab, generator=gen), torch.empty(6, vocab)
        expected = fresh.clone()
        apply_eager(expected, bitmask)
        times = []
        for _ in range(1 + 50 * repeats):
            logits.copy_(fresh)
            t = time.perf_counter()
            fn(logits, bitmask)
            times.append(time.perf_counter() - t)
        out.setdefault("first_call_us", us(times[:1]))
        out[f"{name}_us"] = us(times[1:])
        out["same_as_eager"] = out.get("same_as_eager", True) and bool(torch.equal(logits, expected))
    return out


def package(dist: str, wheel_dirs: list[Path]) -> dict:
    """Version, installed and wheel sizes (MiB), and declared dependencies of a distribution."""
    wheels = [w for d in wheel_dirs for w in d.glob(f"{dist.replace('-', '_')}-*.whl")]
    out = {"wheel": wheels[0].name if wheels else None,
           "wheel_mb": round(wheels[0].stat().st_size / 2**20, 1) if wheels else None}
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return {**out, "installed": False}
    return {**out, "version": md.version(dist), "installed_mb": round(sum(f.size or 0 for f in files) / 2**20, 1),
            "requires": [r for r in md.requires(dist) or [] if "extra ==" not in r]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10, help="setups, compiles and walks per measure (median)")
    p.add_argument("--libraries", nargs="+", choices=list(LIBRARIES), default=list(LIBRARIES))
    p.add_argument("--wheel-dir", type=Path, nargs="*", default=[Path("/tmp/whl")], help="wheels, for their sizes")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    tok = load_tokenizer("smollm2", EngineOptions.from_env().cache_dir)
    results = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__, "vocab": len(tok),
               "eos": tok.eos_token_id, "repeats": a.repeats, "libraries": {},
               "apply_eager_torch": apply_cost(apply_eager, len(tok), a.repeats)}
    for name in a.libraries:
        try:
            lib = LIBRARIES[name]()
        except ImportError as e:
            print(f"{name}: skipped, does not import ({e})", file=sys.stderr)
            continue
        print(f"{name}: tokenizer info, grammars", file=sys.stderr)
        setup_us, info = timed(lambda: lib.setup(tok), a.repeats)
        r = results["libraries"][name] = {"package": package(lib.dist, a.wheel_dir), "setup_us": setup_us,
                                          "grammars": grammars(lib, info, tok, a.repeats)}
        print(f"{name}: speculation, apply", file=sys.stderr)
        r["speculation"] = speculation(lib, info, tok, a.repeats)
        r["apply_6x49152"] = apply_cost(lib.apply, len(tok), a.repeats)
        if name == "xgrammar":
            r["package"]["deps"] = {d: package(d, a.wheel_dir) for d in ("apache-tvm-ffi", "triton")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
