"""EAGLE-3 heads (target_service/head.py): the speculators checkpoint format, the checks against a
target, and serving steps that compute exactly what training unrolls."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import tiny_llama

from target_service.head import Eagle3Head, HeadConfig, HeadError, load_head, save_head


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=256)


def random_head(target, seed: int = 0, **config) -> Eagle3Head:
    config = HeadConfig.for_target(target.config, draft_vocab_size=64, aux_layer_ids=[0, 1, 2], verifier="tiny",
                                   **config) if not config else config["config"]
    torch.manual_seed(seed)
    head = Eagle3Head(config, target.get_input_embeddings())
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens."):
                p.normal_(0, 0.2)
        head.d2t.copy_(torch.arange(64) * 3 - torch.arange(64))  # draft d is target 3d
        head.t2d.zero_()
        head.t2d[torch.arange(64) * 3] = True
    return head.eval()


def test_serving_steps_compute_what_training_unrolls(target):
    """extend over committed pairs then step() on the head's own outputs gives the logits that
    forward_train's teacher-forced steps give at the same index, for any split into extends."""
    head = random_head(target)
    n, t = 14, 9
    torch.manual_seed(1)
    aux, ids = torch.randn(n, 3 * 64), torch.randint(0, 256, (n,))
    with torch.no_grad():
        unrolled = head.forward_train(aux, ids, torch.arange(1, n + 1), steps=3)
    for cuts in ([t + 1], [3, t + 1], [1, 2, 6, t + 1]):
        state, start = head.new_state(capacity=2), 0
        for cut in cuts:
            head.step(head.new_state(1) if state.last is None else state, head.output(state)[0] if state.last is not None
                      else torch.zeros(1, 64), ids[start])  # a proposal's step, dropped by the next extend
            head.extend(state, aux[start:cut], ids[start:cut])
            start = cut
        assert state.committed == t + 1
        torch.testing.assert_close(head.output(state)[1][0], unrolled[0][t], rtol=1e-4, atol=1e-5)
        hidden, logits = head.step(state, head.output(state)[0], ids[t + 1])
        torch.testing.assert_close(logits[0], unrolled[1][t], rtol=1e-4, atol=1e-5)
        _, logits = head.step(state, hidden, ids[t + 2])
        torch.testing.assert_close(logits[0], unrolled[2][t], rtol=1e-4, atol=1e-5)
        head.rollback(state, t)  # a session cut back: the same pair again gives the same output
        head.extend(state, aux[t:t + 1], ids[t:t + 1])
        torch.testing.assert_close(head.output(state)[1][0], unrolled[0][t], rtol=1e-4, atol=1e-5)


def test_speculators_format_round_trip(target, tmp_path):
    head = random_head(target)
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["draft_vocab_size"] == 64 and config["target_hidden_size"] == 64
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    loaded = load_head(str(tmp_path / "head"), target)
    assert loaded.embed_tokens is target.get_input_embeddings()  # no embedding in the file: the target's
    assert torch.equal(loaded.to_target(torch.arange(64)), torch.arange(64) * 3)
    aux, ids = torch.randn(5, 192), torch.randint(0, 256, (5,))
    a, b = head.new_state(8), loaded.new_state(8)
    head.extend(a, aux, ids)
    loaded.extend(b, aux, ids)
    assert torch.equal(head.output(a)[1], loaded.output(b)[1])


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(target_hidden_size=128), "target_hidden_size 128 != the target's hidden_size 64"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=300), "vocab_size 300 != the target's 256"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 7]), "[1, 2, 7] are not three layer ids"),
    (lambda c: c.update(speculators_model_type="medusa"), "not 'eagle3'"),
    (lambda c: c.update(fc_norm=True), "fc_norm = true is not supported"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "only one-layer heads"),
])
def test_a_head_that_does_not_fit_is_refused_naming_why(target, tmp_path, edit, message):
    save_head(random_head(target), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_head(str(tmp_path), target)


def test_weights_that_do_not_match_the_config_are_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file

    save_head(random_head(target), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :128].contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadError, match=r"fc.weight has shape \(64, 128\)"):
        load_head(str(tmp_path), target)
    with pytest.raises(HeadError, match="not a folder"):
        load_head(str(tmp_path / "missing"), target)


def test_the_worker_proposes_what_the_head_computes_from_the_whole_sequence(target):
    """Rounds through the target worker's verifier (head drafts verified, rejected tail cropped, the
    head following every session with the features of each pass, two sessions batched): after each
    verdict the proposal equals a fresh head's greedy chain over the target's features of the whole
    committed sequence, computed apart with the model's own forward."""
    from specdec_core.engine.batched_backend import BatchedBackend
    from specdec_core.engine.kvcache import SessionCaches
    from specdec_core.engine.sampling import SamplingConfig
    from target_service.head_drafter import HeadDrafter
    from target_service.verifier import BatchVerifier, VerifyTask

    head = random_head(target, seed=3)
    backend = BatchedBackend(target)
    verifier = BatchVerifier(SessionCaches(backend, role="target"), 512, head=HeadDrafter(head, 256))
    sessions = {"a": [5, 17, 99, 3, 250, 7], "b": [42, 42, 8]}
    drafts = {"a": [], "b": [9, 9]}  # a wrong draft first: rejected, cropped
    for _ in range(6):
        results = {}
        with ThreadPoolExecutor(2) as pool:
            for sid, result in zip(sessions, pool.map(lambda s: verifier.verify(VerifyTask(
                    s, sessions[s], drafts[s], SamplingConfig(), head_tokens=3)), sessions)):
                results[sid] = result
        for sid, r in results.items():
            sessions[sid] = sessions[sid] + drafts[sid][:r.num_accepted] + [r.next_token_id]
            ids = sessions[sid]
            with torch.no_grad():
                hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
                aux = torch.cat([hidden[i][0] for i in (0, 1)] + [hidden[2][0]], dim=-1)
            fresh = head.new_state(8)
            head.extend(fresh, aux[:-1], torch.tensor(ids[1:]))
            want, (h, logits) = [], head.output(fresh)
            for j in range(3):
                want.append(int(head.to_target(logits[0].argmax())))
                if j < 2:
                    h, logits = head.step(fresh, h, torch.tensor(want[-1]))
            assert r.head_ids == want, (sid, r.head_ids, want)
            drafts[sid] = r.head_ids if sid == "a" else r.head_ids[:1] + [0]  # b: a rejection every round


def test_waiting_feature_rows_behave_as_one_tensor():
    """The head's waiting features (kept as the passes' chunks) against a plain tensor under random
    appends, cuts from either end and reads."""
    import random

    from target_service.head_drafter import Rows

    rng, rows, plain = random.Random(0), Rows(), torch.zeros(0, 2)
    for _ in range(2000):
        op = rng.choice("akdf")
        if op == "a":
            t = torch.randn(rng.randint(0, 5), 2)
            rows.append(t)
            plain = torch.cat([plain, t])
        elif op == "k":
            n = rng.randint(0, len(plain) + 2)
            rows.keep_first(n)
            plain = plain[:n]
        elif op == "d":
            n = rng.randint(0, len(plain) + 2)
            rows.drop_first(n)
            plain = plain[n:]
        elif len(plain):
            n = rng.randint(1, len(plain))
            assert torch.equal(rows.first(n), plain[:n])
        assert len(rows) == len(plain)
        assert torch.equal(torch.cat(rows.chunks) if rows.chunks else torch.zeros(0, 2), plain)
