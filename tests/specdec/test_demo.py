"""`specdec demo` against a fake client: the order of its requests, and its verdicts."""

from __future__ import annotations

from specdec import demo
from specdec.client import Result
from specdec.v1 import generation_pb2 as pb

ANSWER = [11, 12, 13, 14]


class FakeClient:
    """Answers every request with ANSWER (or `alone_ids` for the target alone), recording the calls."""

    def __init__(self, alone_ids: list[int] = ANSWER):
        self.alone_ids = alone_ids
        self.calls: list[tuple[str, str, str]] = []  # (generate | stream, prompt, draft)

    def generate(self, prompt, draft="default", **_) -> Result:
        self.calls.append(("generate", prompt, draft))
        return Result("s", "{}", ANSWER, "stop_token", 5, len(ANSWER), {"rounds": 3, "model_rounds": 1})

    def stream(self, prompt, draft="default", **_):
        self.calls.append(("stream", prompt, draft))
        ids = self.alone_ids if draft == "none" else ANSWER
        yield pb.GenerateStreamResponse(session_id="s", token_ids=ids[:2], text="ab")
        yield pb.GenerateStreamResponse(session_id="s", token_ids=ids[2:], text="cd",
                                        finish_reason=pb.FINISH_REASON_STOP_TOKEN,
                                        usage=pb.Usage(completion_tokens=len(ids)),
                                        stats=pb.SpeculationStats(rounds=2, drafted=3, accepted=2, model_rounds=1))


def test_each_speculative_run_comes_before_its_target_alone_run_and_after_the_earlier_extractions(capsys):
    client = FakeClient()
    assert demo.run(client, "Why?", {"draft": "default", "temperature": None}) == 0
    streams = [(prompt, draft) for kind, prompt, draft in client.calls if kind == "stream"]
    measured = demo.EXTRACTION.format(text=demo.EXTRACTION_TEXTS[-1])
    assert streams == [("Why?", "default"), ("Why?", "none"), (measured, "default"), (measured, "none")]
    earlier = [prompt for kind, prompt, _ in client.calls if kind == "generate" and prompt.startswith("Extract")]
    assert earlier == [demo.EXTRACTION.format(text=t) for t in demo.EXTRACTION_TEXTS[:-1]]
    assert client.calls.index(("stream", measured, "default")) > max(
        client.calls.index(("generate", p, "default")) for p in earlier)
    err = capsys.readouterr().err
    assert err.count("output identical (4 tokens)") == 2
    assert ("policy: the target's draft head for 0 of 2 rounds, suffix for 0, the draft model for 1, no draft for 1"
            in err)  # no suffix_rounds or head_rounds key


def test_a_greedy_answer_that_changes_under_speculation_is_reported_as_a_bug(capsys):
    client = FakeClient(alone_ids=[11, 12, 99, 14])
    assert demo.run(client, "Why?", {"draft": "default"}) == 1
    assert "OUTPUT DIFFERS from the target alone at token 2 (speculative 13, target 99" in capsys.readouterr().err


def test_sampled_answers_are_not_compared_token_by_token(capsys):
    assert demo.run(FakeClient(alone_ids=[1, 2]), "Why?", {"draft": "default", "temperature": 0.7}) == 0
    assert "OUTPUT DIFFERS" not in capsys.readouterr().err


def test_first_difference():
    assert demo.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert demo.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert demo.first_difference([1, 2], [1, 2, 3]) == 2
    assert demo.first_difference([], []) is None


def test_the_slow_warning_appears_only_below_095x(capsys):
    def comparison(spec_tps: float) -> demo.Comparison:
        run = {"decode_tokens_per_s": spec_tps, "token_ids": ANSWER}
        return demo.Comparison(run, {"decode_tokens_per_s": 100.0, "token_ids": ANSWER}, greedy=True)

    demo.summarize({"chat": comparison(96.0), "extraction": comparison(250.0)})
    out = capsys.readouterr().err
    assert "chat: 0.96x" in out and "extraction: 2.50x" in out and "benchmarks/README.md" not in out
    demo.summarize({"chat": comparison(90.0), "extraction": comparison(250.0)})
    assert "(chat: slower than the target alone." in capsys.readouterr().err
