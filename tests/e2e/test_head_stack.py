"""EAGLE-3 heads through the running services (tiny random pair, real Redis, separate processes): a
head trained by `specdec train-head` on the tiny target (the command end to end, in seconds) and
loaded by the target worker from the speculators format; head rounds (one Verify call each) keep
greedy output identical to the target alone under batching and sampled output in the target's exact
distribution; a head that does not fit the target stops the worker at start-up, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec import Client
from specdec.launcher import free_port
from stacks import assert_target_distribution, start_stack

pytestmark = pytest.mark.e2e

PROMPTS = [[504, 3458, 282, 4649, 314], [1073, 2102, 30, 9, 17, 3365, 11, 4500], [42, 7, 900, 3001],
           [77, 2400, 18, 3020, 640, 12]]
N = 24
STAT_IDS = [2033, 148, 3907, 61, 2710]
STAT_CFG = dict(temperature=1.0, top_k=6)
STAT_SAMPLES = 2400


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    """`specdec train-head` on the tiny target: data, vocabulary, training, checkpoint, export."""
    out = tmp_path_factory.mktemp("head")
    command = [sys.executable, "-m", "specdec.cli", "train-head", "--target", tiny_pair[0], "--out", str(out),
               "--prompts", "48", "--max-new-tokens", "32", "--epochs", "4", "--draft-vocab", "2048",
               "--batch", "2", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def stack(tiny_pair, trained, tmp_path_factory):
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), args={"target": ["--head", str(trained / "head")]})
    yield stack
    stack.down()


def generate(stack, prompt: list[int], **kwargs):
    with Client(stack.address("coordinator"), timeout_s=300) as client:
        return client.generate(prompt, end_session=True, **kwargs)


def test_train_head_writes_a_resumable_checkpoint_and_a_speculators_head(trained, tiny_pair):
    config = json.loads((trained / "head" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 2048
    assert config["speculators_config"]["verifier"]["name_or_path"] == tiny_pair[0]
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["tokens_seen"] > 0 and metrics["held_out_positions"] > 0
    assert metrics["acceptance_length"]["4"] >= 1.0
    lines = (trained / "data.jsonl").read_text().splitlines()
    assert len(lines) == 48
    # run again: everything is done, so it resumes at the end and only exports (no new data, no steps)
    again = subprocess.run([sys.executable, "-m", "specdec.cli", "train-head", "--target", tiny_pair[0], "--out",
                            str(trained), "--prompts", "48", "--max-new-tokens", "32", "--epochs", "4",
                            "--draft-vocab", "2048", "--batch", "2", "--quiet"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((trained / "metrics.json").read_text())["optimizer_steps"] == metrics["optimizer_steps"]
    assert (trained / "data.jsonl").read_text().splitlines() == lines


def test_the_target_describes_its_head(stack, trained):
    with Client(stack.address("coordinator")) as client:
        models = client.describe()
    assert models.target.head == str(trained / "head")
    assert models.target.head_parameters > 0


@pytest.mark.lossless
def test_greedy_identical_with_head_drafts_under_batching(stack, hf_greedy):
    """Head rounds, eight sessions at once: every output is the target's own, the head's drafts were
    verified, in shared passes. (A head cannot learn a random model's continuations in seconds, so
    these drafts are rejected: tests/e2e/test_smollm2.py has the embedded model's head accepted, and
    tests/target_service/test_head.py checks each proposal against the head computed apart.)"""
    start = threading.Barrier(2 * len(PROMPTS))

    def run(prompt: list[int]):
        start.wait()
        return generate(stack, prompt, max_new_tokens=N, draft="head", k=4)

    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS * 2))
    for prompt, result in zip(PROMPTS * 2, results):
        assert result.token_ids == hf_greedy(prompt, N)
    assert all(r.stats["drafted"] > 0 for r in results)
    assert max(r.stats["max_verify_batch_size"] for r in results) > 1
    for prompt in PROMPTS:  # and under the default policy, which has the head among its methods
        assert generate(stack, prompt, max_new_tokens=N).token_ids == hf_greedy(prompt, N)


@pytest.mark.lossless
def test_sampled_tokens_with_head_drafts_follow_the_exact_distribution(stack, hf_greedy):
    """STAT_SAMPLES seeded requests at T = 1: the first token is the target's (the first round asks
    the head for its proposal), the second the head's draft under the accept rule with the head's q
    (a third token is the bonus when it is accepted). The first two tokens' counts fit the target's
    exact distribution and reject another temperature's."""
    def sample(seed: int) -> tuple[tuple[int, int], int]:
        r = generate(stack, STAT_IDS, max_new_tokens=3, draft="head", k=1, seed=seed, **STAT_CFG)
        return tuple(r.token_ids[:2]), r.stats["drafted"]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sample, range(STAT_SAMPLES)))
    assert all(drafted == 1 for _, drafted in results)
    counts = Counter(pair for pair, _ in results)
    assert_target_distribution(counts, hf_greedy.model, STAT_IDS, samples=STAT_SAMPLES, **STAT_CFG)


def test_asking_for_the_head_where_the_target_has_none_is_invalid_argument(tiny_stack):
    with Client(tiny_stack.address("coordinator")) as client, pytest.raises(grpc.RpcError) as err:
        client.generate([504, 3458], max_new_tokens=4, draft="head", end_session=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculation.method" in err.value.details() and "no draft head" in err.value.details()


def test_a_head_that_does_not_fit_the_target_stops_the_worker_at_start_up(trained, tmp_path):
    """The same head beside a target of another width: the worker exits at start-up naming what differs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    done = subprocess.run([sys.executable, "-m", "target_service", "--model", str(other), "--head",
                           str(trained / "head"), "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "does not fit the target" in done.stderr and "target_hidden_size 64 != the target's hidden_size 96" in done.stderr
