"""`specdec train-head`: train an EAGLE-3 draft head for a target, the way SpecForge and speculators
do, on a CPU (or a GPU when torch sees one), and export it in the speculators format.

    specdec train-head --target smollm2 --out heads/smollm2 [--prompts 2000] [--hours 3]

Three phases, each resumable (run the same command again after a stop; it continues):
1. data: the target answers training prompts (greedy; target_service/head_prompts.py builds them
   from text installed on the machine, never from the benchmark's prompt sets) and each
   conversation (prompt + answer, token ids) is appended to OUT/data.jsonl. A few percent are held
   out for evaluation.
2. vocabulary: the draft vocabulary is the --draft-vocab most frequent tokens of the data (`t2d`,
   `d2t`); the head's lm_head starts as the target's rows for them.
3. training: for each conversation the target's forward pass gives the features (the residual
   stream entering the three aux layers) and its distribution at every position; the head is
   trained with training-time test (`Eagle3Head.forward_train`: --ttt-steps steps, teacher forcing)
   on the soft cross-entropy against the target's distribution over the draft vocabulary, at every
   position. OUT/checkpoint.pt (head, optimizer, schedule, position) is written every
   --checkpoint-minutes and at the end; the head is exported to OUT/head/ (config.json,
   model.safetensors) with each checkpoint, and its held-out figures to OUT/metrics.json: per draft
   step the accuracy given the steps before were right, and the acceptance length at K = 1..6
   (1 + the expected number of leading draft tokens equal to the target's greedy choice, at
   positions of the target's own answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from target_service.head import Eagle3Head, HeadConfig, save_head

log = logging.getLogger("specdec.train_head")

HELD_OUT_EVERY = 33  # conversation i is held out when i % 33 == 0 (3%)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec train-head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2", help="the target model (a folder, hub id, .gguf or 'smollm2')")
    p.add_argument("--out", type=Path, required=True, help="working folder: data, checkpoint, head/ and metrics")
    p.add_argument("--prompts", type=int, default=2000, help="training prompts the target answers")
    p.add_argument("--max-new-tokens", type=int, default=192, help="the longest answer generated per prompt")
    p.add_argument("--max-length", type=int, default=768, help="conversations are cut to this many tokens")
    p.add_argument("--generate-batch", type=int, default=16, help="prompts answered at once")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most frequent tokens)")
    p.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training (training-time test)")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the training conversations")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=4, help="conversations per optimizer step")
    p.add_argument("--hours", type=float, default=None, help="stop training (checkpointed, exported) after this long")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where a GGUF target is converted (specdec's cache)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (log lines only)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- phase 1: data
def load_target(ref: str, cache_dir: Path | None, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_core.engine.models import resolve_model
    from specdec_core.engine.options import EngineOptions

    path = resolve_model(ref, cache_dir or EngineOptions.from_env().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_data(a: argparse.Namespace, tokenizer, device: str, bar) -> list[tuple[list[int], int]]:
    """Conversations (token ids, where the answer starts), generating the ones OUT/data.jsonl does
    not hold yet: the target answers greedily on the serving engine (BatchedBackend, the target
    worker's kernels), so the head learns from the very tokens the service would produce."""
    from target_service.head_prompts import benchmark_exclusions, training_prompts

    path = a.out / "data.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = [(line["ids"], line["prompt_tokens"]) for line in lines]
    if len(done) >= a.prompts:
        return done[:a.prompts]
    prompts = training_prompts(a.prompts, seed=a.seed, exclude=benchmark_exclusions())[len(done):]
    queue = [prompt_ids(tokenizer, m)[-(a.max_length - a.max_new_tokens):] for m in prompts]
    progress = bar(total=a.prompts, initial=len(done), desc="data: the target answers prompts", unit="prompt")
    started, tokens = time.monotonic(), 0
    with open(path, "a") as f:
        for prompt, answer in greedy_answers(a, queue, tokenizer.eos_token_id, device):
            done.append((prompt + answer, len(prompt)))
            tokens += len(answer)
            f.write(json.dumps({"ids": done[-1][0], "prompt_tokens": len(prompt)}) + "\n")
            f.flush()
            progress.update(1)
            progress.set_postfix_str(f"{tokens / (time.monotonic() - started):.0f} tok/s")
    progress.close()
    return done


def greedy_answers(a: argparse.Namespace, queue: list[list[int]], eos: int, device: str):
    """(prompt, answer) for each prompt, in order, --generate-batch at a time (continuous batching:
    a finished answer's place goes to the next prompt)."""
    from specdec_core.engine.batched_backend import BatchedBackend
    from specdec_core.engine.models import load_causal_lm
    from specdec_core.engine.options import EngineOptions

    options = EngineOptions.from_env()
    if a.cache_dir:
        options = dataclasses.replace(options, cache_dir=a.cache_dir)
    backend = BatchedBackend(load_causal_lm(a.target, options, device=device))
    live: dict[int, tuple[object, list[int], list[int]]] = {}  # index -> (handle, prompt, answer)
    finished: dict[int, list[int]] = {}
    nxt, emitted = 0, 0
    while emitted < len(queue):
        new = []
        while len(live) < a.generate_batch and nxt < len(queue):
            live[nxt] = (backend.allocate(), queue[nxt], [])
            new.append(nxt)
            nxt += 1
        items, order = [], []
        for i, (handle, prompt, answer) in live.items():
            items.append((handle, prompt, 0) if i in new else (handle, answer[-1:], handle.length))
            order.append(i)
        with torch.no_grad():
            logits = backend.forward_batch(items, [1] * len(items))
        for i, row in zip(order, logits):
            handle, prompt, answer = live[i]
            answer.append(int(row[-1].argmax()))
            if answer[-1] == eos or len(answer) >= a.max_new_tokens:
                backend.free(handle)
                finished[i] = answer
                del live[i]
        while emitted in finished:
            yield queue[emitted], finished.pop(emitted)
            emitted += 1


def split(data: list[tuple[list[int], int]]) -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """(the training conversations, the held-out ones with where their answers start)."""
    train = [ids for i, (ids, _) in enumerate(data) if i % HELD_OUT_EVERY]
    held_out = [item for i, item in enumerate(data) if not i % HELD_OUT_EVERY]
    return train, held_out


# ----------------------------------------------------------------------------- phase 2: vocabulary
def draft_vocabulary(data: list[list[int]], vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d [vocab] bool, d2t [size] int64) for the `size` most frequent tokens of the data (then the
    lowest ids, to fill it): draft id d stands for target id d + d2t[d], ids ascending."""
    counts = Counter(t for ids in data for t in ids)
    chosen = [t for t, _ in counts.most_common(size)]
    if len(chosen) < size:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][:size - len(chosen)]
    used = torch.tensor(sorted(chosen), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return t2d, used - torch.arange(size)


# ----------------------------------------------------------------------------- phase 3: training
def features(model, ids: list[int], layer_ids: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3 * hidden], logits [n, vocab]) of the target over one conversation."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
    hidden = out.hidden_states  # [0] embeddings, [i] the input of layer i
    return torch.cat([hidden[i][0] for i in layer_ids], dim=-1), out.logits[0]


def sequence_loss(head: Eagle3Head, aux: torch.Tensor, logits: torch.Tensor, ids: list[int], t2d: torch.Tensor,
                  steps: int, answer_from: int | None = None):
    """The TTT loss over one conversation (the mean over steps of the soft cross-entropy at every
    valid position) and, per step, (right given the steps before were right, positions counted) at
    answer positions when answer_from is given."""
    device = aux.device
    n = len(ids) - 1  # pairs (g_i, x_{i+1}) for i < n; row i of step s predicts x_{i+2+s}
    input_ids = torch.tensor(ids[1:], device=device)
    targets = F.softmax(logits[1:, t2d], dim=-1)  # row i: the target's distribution for x_{i+2}
    target_greedy = logits[1:].argmax(-1)
    step_logits = head.forward_train(aux[:-1], input_ids, torch.arange(1, n + 1, device=device), steps)
    loss = aux.new_zeros(())
    counts = []
    right = torch.ones(n, dtype=torch.bool, device=device)
    for s, lg in enumerate(step_logits):
        rows = n - 1 - s  # rows whose target exists (x_{i+2+s} is within the conversation)
        if rows <= 0:
            break
        loss = loss + torch.sum(-(targets[s:s + rows] * F.log_softmax(lg[:rows].float(), -1)).sum(-1)) / rows
        if answer_from is not None:
            with torch.no_grad():
                guess = head.to_target(lg[:rows].argmax(-1))
                right = right[:rows] & (guess == target_greedy[s:s + rows])
                # chains that start in the answer (x_{i+2} onwards is what the target generated greedily)
                mask = torch.arange(rows, device=device) + 2 >= answer_from
                counts.append((int((right & mask).sum()), int(mask.sum())))
    return loss / steps, counts


def evaluate(head, model, held_out: list[tuple[list[int], int]], t2d, a, device) -> dict:
    """Held-out figures: conditional accuracy per draft step and acceptance length at K = 1..6."""
    head.eval()
    steps = max(a.ttt_steps, 6)
    totals = [[0, 0] for _ in range(steps)]
    losses = []
    with torch.no_grad():
        for ids, answer_from in held_out:
            aux, logits = features(model, ids, head.config.aux_layer_ids, device)
            loss, counts = sequence_loss(head, aux, logits, ids, t2d, steps, answer_from)
            losses.append(float(loss))
            for s, (r, n) in enumerate(counts):
                totals[s][0] += r
                totals[s][1] += n
    head.train()
    base = max(totals[0][1], 1)
    reach = [r / base for r, _ in totals]  # P(the first s+1 draft tokens are all right)
    return {"held_out_conversations": len(held_out), "held_out_positions": totals[0][1],
            "loss": sum(losses) / max(len(losses), 1),
            "accuracy_by_step": [r / n if n else None for r, n in totals],
            "acceptance_length": {k: 1 + sum(reach[:k]) for k in range(1, steps + 1)}}


def train(a: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    bar = _bar(a.quiet)
    model, tokenizer = load_target(a.target, a.cache_dir, device)
    data = [(ids[:a.max_length], start) for ids, start in make_data(a, tokenizer, device, bar)]
    train_set, held_out = split(data)
    config = model.config
    head_config = HeadConfig.for_target(config, a.draft_vocab, verifier=a.target)
    head = Eagle3Head(head_config, model.get_input_embeddings()).to(device)
    t2d, d2t = draft_vocabulary(train_set, config.vocab_size, head_config.draft_vocab_size)
    _init(head, model, t2d, d2t)
    trainable = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")]
    optimizer = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = max(1, math.ceil(len(train_set) * a.epochs / a.batch))
    warmup = max(1, total_steps // 50)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(
        0.05, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))))
    state = {"step": 0, "seen_tokens": 0, "seconds": 0.0}
    checkpoint = a.out / "checkpoint.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        state = saved["state"]
        log.info("resuming at optimizer step %d of %d", state["step"], total_steps)
    order = _order(len(train_set), total_steps * a.batch, a.seed)
    head.train()
    started, last_save = time.monotonic(), time.monotonic()
    metrics: dict = {}
    progress = bar(total=total_steps, initial=state["step"], desc="training the head", unit="step")
    window: list[float] = []
    while state["step"] < total_steps:
        loss_sum = 0.0
        for j in range(a.batch):
            ids = train_set[order[state["step"] * a.batch + j]]
            aux, logits = features(model, ids, head_config.aux_layer_ids, device)
            loss, _ = sequence_loss(head, aux, logits, ids, t2d, a.ttt_steps)
            (loss / a.batch).backward()
            loss_sum += float(loss) / a.batch
            state["seen_tokens"] += len(ids)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        state["step"] += 1
        window = (window + [loss_sum])[-50:]
        elapsed = state["seconds"] + time.monotonic() - started
        progress.update(1)
        progress.set_postfix_str(f"loss {sum(window) / len(window):.3f} · {state['seen_tokens']:,} tokens")
        out_of_time = a.hours is not None and elapsed >= a.hours * 3600
        if out_of_time or state["step"] == total_steps or time.monotonic() - last_save >= a.checkpoint_minutes * 60:
            metrics = _save(a, head, optimizer, schedule, state, elapsed, model, train_set, held_out, t2d, device)
            last_save = time.monotonic()
            progress.write(f"checkpoint at step {state['step']}: held-out acceptance length at K=4 "
                           f"{metrics['acceptance_length'][4]:.2f}, accuracy by step "
                           f"{[round(x, 3) for x in metrics['accuracy_by_step'] if x is not None]}")
        if out_of_time:
            break
    progress.close()
    if not metrics:  # resumed after the last step: export again
        metrics = _save(a, head, optimizer, schedule, state, state["seconds"], model, train_set, held_out, t2d, device)
    return metrics


def _save(a, head, optimizer, schedule, state, elapsed, model, train_set, held_out, t2d, device) -> dict:
    state = {**state, "seconds": elapsed}
    tmp = a.out / "checkpoint.pt.tmp"
    torch.save({"head": {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")},
                "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "state": state}, tmp)
    os.replace(tmp, a.out / "checkpoint.pt")
    save_head(head, a.out / "head", proposal_tokens=a.ttt_steps, dtype=torch.float16)
    metrics = evaluate(head, model, held_out, t2d, a, device)
    metrics.update({"target": a.target, "optimizer_steps": state["step"], "tokens_seen": state["seen_tokens"],
                    "training_hours": elapsed / 3600, "conversations": len(train_set) + len(held_out),
                    "train_tokens": sum(map(len, train_set)),
                    "draft_vocab": head.config.draft_vocab_size, "ttt_steps": a.ttt_steps,
                    "device": "cuda" if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"})
    (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def _init(head: Eagle3Head, model, t2d: torch.Tensor, d2t: torch.Tensor) -> None:
    """lm_head from the target's rows for the draft vocabulary; small random weights elsewhere."""
    with torch.no_grad():
        head.t2d.copy_(t2d)
        head.d2t.copy_(d2t)
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[t2d])
        for name, p in head.named_parameters():
            if name.startswith(("embed_tokens.", "lm_head.")) or name.endswith("norm.weight"):
                continue
            torch.nn.init.normal_(p, std=0.02)


def _order(n: int, count: int, seed: int) -> list[int]:
    """Epoch after epoch, each a fresh permutation (deterministic: a resumed run continues it)."""
    rng, order = random.Random(seed), []
    while len(order) < count:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order += epoch
    return order[:count]


def _bar(quiet: bool):
    from tqdm import tqdm

    def bar(**kw):
        return tqdm(disable=quiet, dynamic_ncols=True, **kw)
    return bar


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    metrics = train(a)
    print(json.dumps({k: metrics[k] for k in ("acceptance_length", "accuracy_by_step", "tokens_seen",
                                              "training_hours")}, indent=1))
    print(f"head written to {a.out / 'head'} (load it with: specdec target --head {a.out / 'head'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
