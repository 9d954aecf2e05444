"""Structured outputs on the embedded pair: the 22 JSON-schema requests of benchmarks/schemas.py
under each speculation configuration against plain decoding (K = 0), and what the grammar costs.

    .venv/bin/python benchmarks/structured.py [--quick] [--waves 2] [--concurrency 8]
                                              [--max-new-tokens 200] [--out benchmarks/results/structured]

One stack serves every configuration (per-request flags), each configuration's pass as a tenant of
its own (the suffix index is per tenant: no pass drafts from another configuration's outputs, nor
from an earlier pass over the same requests; within a pass, a request sees the pass's earlier
requests, of other schemas). At c1 every schema goes through every configuration in turn (the
order rotated per request), --waves times, pooled; at --concurrency the whole set per
configuration, 8 at a time, --waves times, pooled. Every output must validate against its schema and be
token-identical to K = 0's (greedy): the run fails otherwise.

The grammar's cost is read from the services' own metrics (`specdec_grammar_seconds_total`,
scraped from coordinator, draft and target before and after each row): masks computed and applied
on both workers, proposals cut in the coordinator. grammar_ms_per_token = those seconds over the
row's generated tokens; grammar_share_of_round = those seconds over the c1 requests' walls (at c1 a
request has the stack to itself, so its wall is the sum of its rounds).

Writes <out>.json, and merges its summary keys into benchmarks/results/latest.json's summary
(structured_c1_default_vs_k0, grammar_ms_per_token, ...) when that file exists.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import jsonschema  # noqa: E402

import stacks  # noqa: E402
from measure import Progress, Request, config_stats, machine  # noqa: E402
from schemas import SCHEMAS, messages  # noqa: E402
from specdec.launcher import free_port, scrape_metrics  # noqa: E402

CONFIGS = {
    "target_k0": {"draft": "none", "k": 0},
    "default": {"draft": "default"},
    "model_k4_overlap": {"draft": "model", "k": 4, "overlap": True},
    "suffix_k8": {"draft": "suffix", "k": 8},
}
ROLES = ("coordinator", "draft", "target")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="check the harness: 3 schemas, 1 wave, 64 tokens, c2")
    p.add_argument("--waves", type=int, default=None, help="passes over the schemas at c1 (default 2)")
    p.add_argument("--concurrency", type=int, default=None, help="the concurrent row's level (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 200 (every schema ends within it)")
    p.add_argument("--out", default=str(HERE / "results" / "structured"), help="output path without suffix")
    return p.parse_args(argv)


def tenant(config: str, concurrency: int, wave: int) -> str:
    """The tenant one configuration's pass is sent as."""
    return f"{config}.c{concurrency}.w{wave + 1}"


class GrammarMeter:
    """Grammar seconds and masked rows, summed over the services' metrics."""

    def __init__(self, ports: dict[str, int]):
        self.ports = ports

    def read(self) -> dict[str, float]:
        total = {"mask_s": 0.0, "cut_s": 0.0, "compile_s": 0.0, "rows": 0.0}
        for port in self.ports.values():
            m = scrape_metrics(port)
            for step in ("mask", "cut", "compile"):
                total[f"{step}_s"] += m.get(f'specdec_grammar_seconds_total{{step="{step}"}}', 0.0)
            total["rows"] += m.get("specdec_grammar_rows_total", 0.0)
        return total


def send(client, index: int, options: dict, max_new: int) -> Request:
    _, prompt, schema = SCHEMAS[index]
    return stacks.specdec_request(client, index, messages(prompt),
                                  {**options, "json_schema": schema, "max_new_tokens": max_new})


def check(requests: list[Request], tokenizer, reference: dict[int, list[int]] | None, name: str) -> None:
    """Every output validates against its schema, and (greedy) equals K = 0's."""
    for r in requests:
        text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[r.prompt_index][2])
        except (ValueError, jsonschema.ValidationError) as exc:
            raise SystemExit(f"{name}: schema {SCHEMAS[r.prompt_index][0]} gave invalid output {text!r}: {exc}")
        if reference is not None and r.token_ids != reference[r.prompt_index]:
            raise SystemExit(f"{name}: schema {SCHEMAS[r.prompt_index][0]}: output differs from K = 0's")


def row(name: str, concurrency: int, requests: list[Request], wall_s: float, grammar: dict) -> dict:
    tokens = sum(len(r.token_ids) for r in requests)
    request_wall = sum(r.wall_s for r in requests)
    grammar_s = grammar["mask_s"] + grammar["cut_s"]
    return {"config": name, "concurrency": concurrency, **config_stats(requests, wall_s, CONFIGS[name].get("k")),
            "requests": [r.record() for r in requests], "grammar": grammar,
            "grammar_ms_per_token": grammar_s * 1e3 / tokens if tokens else None,
            "grammar_share_of_request_wall": grammar_s / request_wall if request_wall else None}


def bench_c1(clients, meter, schemas: list[int], waves: int, max_new: int, quiet, progress) -> dict[str, tuple]:
    names = list(CONFIGS)
    done = {n: [] for n in names}
    grammar = {n: {"mask_s": 0.0, "cut_s": 0.0, "compile_s": 0.0, "rows": 0.0} for n in names}
    for wave in range(waves):
        for j, index in enumerate(schemas):
            turn = (j + wave) % len(names)
            for name in names[turn:] + names[:turn]:
                quiet()
                before = meter.read()
                request = send(clients(tenant(name, 1, wave)), index, CONFIGS[name], max_new)
                after = meter.read()
                for key in grammar[name]:
                    grammar[name][key] += after[key] - before[key]
                done[name].append(request)
                progress(f"[c1 pass {wave + 1}] {name} {SCHEMAS[index][0]}: {len(request.token_ids)} tokens, "
                         f"{len(request.token_ids) / request.wall_s:.1f} tok/s")
    return {n: (done[n], sum(r.wall_s for r in done[n]), grammar[n]) for n in names}


def bench_concurrent(address, tokens, meter, schemas: list[int], c: int, waves: int, max_new: int, quiet,
                     progress) -> dict:
    """Each configuration: the whole set, c requests at a time (c clients, the pass's tenant), the
    configurations in turn, --waves times, pooled."""
    out = {name: ([], 0.0, dict.fromkeys(("mask_s", "cut_s", "compile_s", "rows"), 0.0)) for name in CONFIGS}
    for wave, name in itertools.product(range(waves), CONFIGS):
        quiet()
        clients = [stacks.Client(address, token=tokens(tenant(name, c, wave)), timeout_s=stacks.CLIENT_TIMEOUT_S)
                   for _ in range(c)]
        before = meter.read()
        try:
            requests, wall = stacks.run_concurrently(
                [(i, i) for i in schemas], c, lambda t, index, _: send(clients[t], index, CONFIGS[name], max_new),
                lambda request, started: None)
        finally:
            for client in clients:
                client.close()
        after = meter.read()
        done, total, grammar = out[name]
        out[name] = (done + requests, total + wall, {k: grammar[k] + after[k] - before[k] for k in grammar})
        progress(f"[c{c} pass {wave + 1}] {name}: {sum(len(r.token_ids) for r in requests) / wall:.1f} tok/s")
    return out


def summary(rows: list[dict], c: int) -> dict:
    def get(name: str, level: int) -> dict:
        return next(r for r in rows if r["config"] == name and r["concurrency"] == level)

    def vs_k0(name: str, level: int) -> float:
        return get(name, level)["tokens_per_s"] / get("target_k0", level)["tokens_per_s"]

    default = get("default", 1)
    return {
        "structured_c1_default_vs_k0": vs_k0("default", 1),
        f"structured_c{c}_default_vs_k0": vs_k0("default", c),
        "structured_c1_model_k4_vs_k0": vs_k0("model_k4_overlap", 1),
        "structured_c1_suffix_k8_vs_k0": vs_k0("suffix_k8", 1),
        "grammar_ms_per_token": default["grammar_ms_per_token"],
        "grammar_share_of_round_c1": default["grammar_share_of_request_wall"],
        "grammar_ms_per_token_k0": get("target_k0", 1)["grammar_ms_per_token"],
    }


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    progress = Progress()
    waves = a.waves or (1 if a.quick else 2)
    c = a.concurrency or (2 if a.quick else 8)
    max_new = a.max_new_tokens or (64 if a.quick else 200)
    schemas = list(range(3 if a.quick else len(SCHEMAS)))
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-structured-"))
    tokens = stacks.TenantTokens([tenant(n, level, wave) for n in CONFIGS for level in (1, c) for wave in range(waves)]
                                 + [tenant("target_k0", 1, -1)], log_dir / "auth_tokens")
    ports = {role: free_port() for role in ROLES}
    stack = stacks.Stack(log_dir=log_dir, args={
        "coordinator": [*tokens.coordinator_args, "--metrics-port", str(ports["coordinator"])],
        "draft": ["--metrics-port", str(ports["draft"])], "target": ["--metrics-port", str(ports["target"])]})
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine_at_start": machine(), "argv": sys.argv[1:],
            "configs": CONFIGS, "schemas": [s[0] for s in SCHEMAS], "waves": waves, "max_new_tokens": max_new,
            "logs": str(log_dir)}
    from specdec_core.engine.models import load_tokenizer
    from specdec_core.engine.options import EngineOptions

    tokenizer = load_tokenizer("smollm2", EngineOptions.from_env().cache_dir)
    progress(f"starting the stack (logs in {log_dir}) ...")
    stack.up()
    clients = stacks.TenantClients(stack.address("coordinator"), tokens)
    try:
        meter, quiet = GrammarMeter(ports), stacks.quiet(stack)
        send(clients(tenant("target_k0", 1, -1)), 0, CONFIGS["target_k0"], 16)  # warm-up (compiles, caches), unmeasured
        rows = []
        measured = bench_c1(clients, meter, schemas, waves, max_new, quiet, progress)
        reference = {r.prompt_index: r.token_ids for r in measured["target_k0"][0]}
        measured_c = bench_concurrent(stack.address("coordinator"), tokens, meter, schemas, c, waves, max_new, quiet,
                                      progress)
        for level, results in ((1, measured), (c, measured_c)):
            for name, (requests, wall, grammar) in results.items():
                check(requests, tokenizer, reference, f"{name} c{level}")
                rows.append(row(name, level, requests, wall, grammar))
    finally:
        clients.close()
        stack.down()
    result = {"meta": {**meta, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": progress.elapsed()},
              "summary": summary(rows, c), "rows": rows}
    out = Path(a.out).with_suffix(".json")
    out.write_text(json.dumps(result, indent=1))
    latest = HERE / "results" / "latest.json"
    if latest.exists() and not a.quick:
        data = json.loads(latest.read_text())
        data["summary"].update({k: v for k, v in result["summary"].items()})
        data["summary"]["_structured_source"] = str(out.relative_to(HERE.parent))
        latest.write_text(json.dumps(data, indent=1))
    progress(f"wrote {out}")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
