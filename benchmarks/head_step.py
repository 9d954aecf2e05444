"""What a draft-head step costs against a target decode pass, in the target worker's own code, on
this machine: the embedded model (or --target) on `BatchedBackend` decoding one token for one
session at a context of --context tokens, against `HeadDrafter` proposing --tokens tokens after the
same context (each token: the head's layer, its draft-vocabulary logits back in the target's
vocabulary, greedy choice), and what absorbing one round's pairs costs. Warm, interleaved, the
median of --repeats.

    .venv/bin/python benchmarks/head_step.py [--target smollm2] [--head auto] [--context 300]
        [--tokens 4] [--repeats 60] [--threads 2]

Writes benchmarks/results/head_step.json (`head_step_vs_target_pass`: one head token's ms over one
target pass's ms); benchmarks/run.py carries it into its summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from specdec_core.engine.batched_backend import BatchedBackend  # noqa: E402
from specdec_core.engine.kvcache import SessionCaches  # noqa: E402
from specdec_core.engine.models import load_causal_lm  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402
from specdec_core.engine.sampling import SamplingConfig  # noqa: E402
from target_service.head import EMBEDDED_HEAD, load_head  # noqa: E402
from target_service.head_drafter import HeadDrafter  # noqa: E402
from target_service.verifier import BatchVerifier, VerifyTask  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--head", default="auto", help="a head folder (auto: the one shipped for the embedded model)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "head_step.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = load_causal_lm(a.target, EngineOptions.from_env())
    backend = BatchedBackend(model)
    head = load_head(str(EMBEDDED_HEAD) if a.head == "auto" else a.head, model).for_cpu()  # as the worker runs it
    drafter = HeadDrafter(head, backend.vocab_size)
    verifier = BatchVerifier(SessionCaches(backend, role="target"), backend.max_context, head=drafter)
    ids = [int(t) for t in torch.randint(100, 20000, (a.context,), generator=torch.Generator().manual_seed(0))]
    greedy = SamplingConfig()
    result = verifier.verify(VerifyTask("bench", ids, [], greedy, head_tokens=a.tokens))  # prefill, warm
    ids = ids + [result.next_token_id]
    seq = verifier.caches._sequences["bench"]
    passes, heads, absorbs = [], [], []
    for _ in range(a.repeats):
        # a target decode pass: one token after the context (cropped off again: the same context each time)
        started = time.perf_counter()
        with torch.no_grad():
            backend.forward(seq.handle, ids[-1:], len(ids) - 1, 1)
        passes.append((time.perf_counter() - started) * 1e3)
        backend.crop(seq.handle, len(ids) - 1)
        # the head's proposal after the same context
        started = time.perf_counter()
        proposal, _ = drafter.propose(seq, ids, a.tokens, greedy, 0)
        heads.append((time.perf_counter() - started) * 1e3 / max(1, len(proposal)))
        # absorbing one pair again (what a round's verdict adds)
        state = seq.head.state
        aux = torch.randn(1, len(head.config.aux_layer_ids) * head.config.target_hidden_size)
        head.rollback(state, state.committed - 1)
        del seq.head.tokens[-1:]
        started = time.perf_counter()
        drafter.absorb(seq, len(ids) - 2, aux, ids, now=True)
        absorbs.append((time.perf_counter() - started) * 1e3)
    target_ms, head_ms, absorb_ms = (statistics.median(x) for x in (passes, heads, absorbs))
    out = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": a.target, "context": a.context,
           "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats,
           "target_pass_ms": target_ms, "head_ms_per_token": head_ms, "absorb_pair_ms": absorb_ms,
           "head_step_vs_target_pass": head_ms / target_ms,
           "head_parameters": head.num_parameters,
           "target_parameters": backend.num_parameters}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
