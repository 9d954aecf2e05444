"""`specdec`: run the services, the whole local stack, or talk to a deployment.

    specdec demo                      # local stack on the embedded model: a chat and a repetitive request, speedups
    specdec up                        # local stack; Ctrl-C (or SIGTERM, SIGHUP) stops it
    specdec generate "Why is the sky blue?" --address localhost:50050
    specdec generate "Name a colour." --json-schema '{"type": "object", "properties": {"colour": {"type": "string"}}}'
    specdec coordinator|draft|target --help
    specdec train-head --target smollm2 --out heads/smollm2   # an EAGLE-3 draft head for a target
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from specdec import demo
from specdec.client import DRAFT_METHODS, Client, chat_message, tool
from specdec.terminal import stream_to_terminal

SERVICES = {"coordinator": "coordinator", "draft": "draft_service", "target": "target_service"}
TOOLS = {"train-head": "target_service.train_head"}  # run in this process, flags passed through
DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
DEMO_HELP = """Start the local stack on the embedded model (as `specdec up` does) and answer two requests,
each first with speculation (the coordinator's policy, unless --draft or -k say otherwise) and then
with the target alone:
  - PROMPT, a chat answer, streamed;
  - a repetitive request: the same JSON extraction over a new text, after three earlier ones whose
    prompts and answers the coordinator's suffix index has seen.
For each: the speedup, which drafting method the policy chose per round, and whether the two answers
are token-identical, as greedy decoding requires (exit status 1 if they are not). Then the stack stops."""


GENERATE_HELP = """Generate from a running coordinator, streaming the text to stdout and a line of stats to stderr.

A one-shot request ends its session when it has finished; --keep-session keeps it (its id is in the
stats line), and --session ID continues one (kept, unless --end-session).

examples:
  specdec generate "Why is the sky blue?" --max-new-tokens 64
  specdec generate "Is the sky blue?" --choice yes --choice no
  specdec generate "A user record for Ada." --json-schema user.schema.json
  specdec generate "What is the weather in Paris?" --tool weather.json --keep-session
  specdec generate --messages conversation.json --tool weather.json"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES | TOOLS:  # run a service or tool in this process, flags passed through
        os.execv(sys.executable, [sys.executable, "-m", (SERVICES | TOOLS)[argv[0]], *argv[1:]])
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    for name, module in SERVICES.items():
        sub.add_parser(name, help=f"run the {name} service (python -m {module}; see `specdec {name} --help`)")
    sub.add_parser("train-head", help="train an EAGLE-3 draft head for a target, export it in the speculators format "
                   "(see `specdec train-head --help`)")

    g = sub.add_parser("generate", help="generate from a running coordinator, streaming to the terminal",
                       description=GENERATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", nargs="?", help="the prompt (sent as a user chat message unless --raw or --token-ids; "
                   "with --messages, appended to them as a user message)")
    g.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "localhost:50050"))
    g.add_argument("--token", default=os.environ.get("SPECDEC_TOKEN", ""), help="bearer token (or SPECDEC_TOKEN)")
    g.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA", ""), help="CA file: connect with TLS")
    inp = g.add_argument_group("input")
    form = inp.add_mutually_exclusive_group()
    form.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    form.add_argument("--token-ids", action="store_true",
                      help="the prompt is token ids ('1 2 3' or '1,2,3'), sent as they are")
    form.add_argument("--messages", metavar="FILE_OR_JSON", type=_json_arg,
                      help="a conversation to send: a JSON list of chat messages (OpenAI's shape, assistant "
                           "tool_calls and tool messages included), or a file holding one")
    inp.add_argument("--tool", dest="tools", action="append", default=[], metavar="FILE_OR_JSON", type=_json_arg,
                     help="a function the model may call (repeatable; a JSON list adds several): OpenAI's "
                          '{"type": "function", "function": {"name", "description", "parameters"}} or the flat '
                          '{"name", "description", "parameters"}; JSON text or a file. Chat only')
    _generation_flags(g)
    g.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=int, default=[], metavar="ID",
                   help="stop after this token id (repeatable; the model's end-of-sequence tokens always stop)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", type=_logit_bias_arg,
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the text, print each token's log-probability and its N most likely alternatives "
                        "(0..20) to stderr")
    c = g.add_argument_group("structured output", "constrain the output (at most one of these); the server "
                             "answers INVALID_ARGUMENT if it does not compile")
    constraint = c.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE_OR_JSON", type=_json_schema_arg,
                            help="the output is JSON valid against this JSON schema (JSON text or a file)")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", help="the whole output matches this regular expression (Rust regex syntax)")
    constraint.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is exactly one of these strings (repeat: --choice yes --choice no)")
    constraint.add_argument("--grammar", metavar="FILE_OR_TEXT", type=_text_arg,
                            help="a context-free grammar the output follows: Lark, or GBNF/EBNF (`name ::= ...` "
                                 "rules); its text or a file")
    sess = g.add_argument_group("session")
    sess.add_argument("--session", default="", help="continue this session")
    keep = sess.add_mutually_exclusive_group()
    keep.add_argument("--end-session", dest="end_session", action="store_const", const=True, default=None,
                      help="end the session when the request has finished (the default without --session)")
    keep.add_argument("--keep-session", dest="end_session", action="store_const", const=False,
                      help="keep the session, to continue it with --session (the default with --session)")
    sess.add_argument("--request-id", default="", help="makes the request idempotent: a retry with the same id "
                      "appends nothing (default: a fresh id, which the client's own retries reuse)")
    g.add_argument("--quiet", action="store_true", help="print only the text")
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="run the whole stack locally (embedded Redis, draft, target, coordinator)",
                       description="Run Redis, draft, target and coordinator locally until Ctrl-C, SIGTERM or "
                                   "SIGHUP, which stop all of them (and whatever they started).")
    _stack_flags(u)
    u.add_argument("--openai-port", type=int, default=8000,
                   help="port of the OpenAI-compatible HTTP API (default 8000; 0: do not start it)")
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("demo", help="start the local stack; a chat answer and a repetitive request, with and "
                       "without speculation", description=DEMO_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _stack_flags(d)
    d.add_argument("prompt", nargs="?", default=DEMO_PROMPT, help=f"the chat request (default: {DEMO_PROMPT!r})")
    _generation_flags(d, max_new_tokens=128)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("session", help="show or end a session")
    s.add_argument("action", choices=["show", "end"])
    s.add_argument("session_id")
    s.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "localhost:50050"))
    s.set_defaults(func=cmd_session)

    m = sub.add_parser("models", help="describe the models behind a coordinator")
    m.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "localhost:50050"))
    m.set_defaults(func=cmd_models)

    from specdec.loadtest import add_arguments as loadtest_arguments  # no locust import until it runs

    lt = sub.add_parser("loadtest", help="load-test a running coordinator with locust (needs `pip install locust`)")
    loadtest_arguments(lt)
    lt.set_defaults(func=cmd_loadtest)
    return p


def _generation_flags(p: argparse.ArgumentParser, max_new_tokens: int | None = None) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=None, help="0 or unset: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share of the top one's probability")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="transformers' (> 0; 1: off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--draft", choices=list(DRAFT_METHODS), default="default",
                   help="drafting method; none = plain target decoding; default: the coordinator's policy "
                        "chooses the method and K every round (unless -k is given: the draft model with that K)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None, help="draft tokens per round")
    p.add_argument("--adaptive", action="store_true", help="with --draft model or suffix: choose per round between "
                   "it (at most -k tokens) and no draft, from the measured acceptance and costs")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="draft the next block while the target verifies this one (default: the server's)")
    p.add_argument("--min-draft-confidence", type=float, default=0.0,
                   help="end a draft block when the draft's confidence falls below this")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="plain tokens a round without a draft asks the target for after its verdict, in one "
                        "call (default: the server's; 0: one token per call, smoothest streaming)")


def _stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="smollm2", help="hub id, folder, .gguf, or smollm2 (default)")
    p.add_argument("--draft-model", default="smollm2", help="hub id, folder, .gguf, or smollm2 (default)")
    p.add_argument("--draft-backend", default="auto", choices=["auto", "transformers", "llama.cpp"],
                   help="auto: for a GGUF draft, this project's engine in llama.cpp's 8-bit arithmetic where the "
                        "CPU has AVX-512 VNNI, else llama.cpp")
    p.add_argument("--port", type=int, default=50050, help="coordinator port")
    p.add_argument("--log-dir", default=None, help="write each service's log here (default: a temp folder)")
    p.add_argument("--redis-data", default="", help="keep sessions in an append-only file in this folder "
                   "(fsync every second), so they survive a restart; default: in memory only")
    p.add_argument("--kv-store-mb", type=int, default=1024,
                   help="the workers' KV tier: a private Redis of this many MB that keeps sessions' KV chunks "
                        "(least recently used evicted), so that a restarted worker or a new session with a known "
                        "prefix restores instead of prefilling; 0: off; KV_STORE_URL: use that Redis instead")


def _gen_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop, draft=a.draft, k=a.k,
                adaptive=a.adaptive, overlap=a.overlap, min_draft_confidence=a.min_draft_confidence,
                decode_steps=a.decode_steps)


def _read_arg(value: str) -> str:
    """FILE_OR_TEXT: a file's contents if value names a file, else value itself."""
    return Path(value).read_text() if value and os.path.isfile(value) else value


def _json_arg(value: str):
    text = _read_arg(value)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"neither a file nor JSON ({err})") from None


def _json_schema_arg(value: str) -> str:
    text = _read_arg(value)
    _json_arg(text)  # refused here if it is not JSON, sent as written
    return text


def _text_arg(value: str) -> str:
    return _read_arg(value)


def _logit_bias_arg(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not ID=BIAS") from None


def _request_input(a: argparse.Namespace) -> tuple:
    """The prompt and the keyword arguments that choose its form."""
    if a.messages is not None:
        messages = a.messages["messages"] if isinstance(a.messages, dict) else a.messages
        messages = [chat_message(m) for m in messages]
        if a.prompt is not None:
            messages.append(chat_message({"role": "user", "content": a.prompt}))
        if not messages:
            raise SystemExit("specdec generate: error: --messages is empty and there is no prompt")
        return messages, {}
    if a.prompt is None:
        raise SystemExit("specdec generate: error: a prompt (or --messages) is required")
    if a.token_ids:
        try:
            return [int(t) for t in a.prompt.replace(",", " ").split()], {}
        except ValueError:
            raise SystemExit(f"specdec generate: error: --token-ids: {a.prompt!r} is not token ids") from None
    return a.prompt, {"chat": not a.raw}


def _request_kwargs(a: argparse.Namespace) -> dict:
    """Every request field the generate command sets beyond the generation flags it shares with demo."""
    tools = [t for arg in a.tools for t in (arg if isinstance(arg, list) else [arg])]
    try:
        tools = [tool(t) for t in tools]
    except (ValueError, TypeError, AttributeError) as err:
        raise SystemExit(f"specdec generate: error: --tool: {err}") from None
    return dict(session_id=a.session, end_session=not a.session if a.end_session is None else a.end_session,
                request_id=a.request_id, stop_token_ids=a.stop_token_ids, logit_bias=dict(a.logit_bias),
                logprobs=a.logprobs, tools=tools, json_schema=a.json_schema, json_object=a.json_object,
                regex=a.regex, choice=a.choice, grammar=a.grammar)


class _KeepLogprobs:
    """A client whose streams also collect each chunk's log-probabilities."""

    def __init__(self, client: Client):
        self.client = client
        self.logprobs: list = []

    def stream(self, prompt, **kwargs):
        for chunk in self.client.stream(prompt, **kwargs):
            self.logprobs.extend(chunk.logprobs)
            yield chunk


def _print_logprobs(logprobs: list) -> None:
    for lp in logprobs:
        top = "  ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top)
        print(f"{lp.chosen.token!r}\t{lp.chosen.logprob:.4f}" + (f"\t| {top}" if top else ""), file=sys.stderr)


def cmd_generate(a: argparse.Namespace) -> int:
    prompt, form = _request_input(a)
    with Client(a.address, token=a.token, tls_ca=a.tls_ca) as client:
        recorder = _KeepLogprobs(client)
        stream_to_terminal(recorder, prompt, quiet=a.quiet, **form, **_gen_kwargs(a), **_request_kwargs(a))
    if a.logprobs is not None:
        _print_logprobs(recorder.logprobs)
    return 0


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP (a supervisor, a closed terminal) stop the stack as Ctrl-C does: they
    raise KeyboardInterrupt, so the same `stack.down()` runs."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def _stop(stack) -> None:
    """Stop the stack; a second Ctrl-C, SIGTERM or SIGHUP meanwhile must not cut that short."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    stack.down()


def _start_stack(a: argparse.Namespace):
    import tempfile
    from pathlib import Path

    from specdec.launcher import Stack

    _stop_on_signals()
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="specdec-logs-"))
    stack = Stack(target_model=a.target_model, draft_model=a.draft_model, redis_url=os.environ.get("REDIS_URL", ""),
                  redis_data=a.redis_data, log_dir=log_dir, args={"draft": ["--backend", a.draft_backend]},
                  kv_store_url=os.environ.get("KV_STORE_URL", ""), kv_store_mb=a.kv_store_mb)
    stack.ports["coordinator"] = a.port
    if getattr(a, "openai_port", 0):
        stack.openai = True
        stack.ports["openai"] = a.openai_port
    print(f"specdec: preparing models (first run converts the GGUF once, ~1 min); logs in {log_dir}", file=sys.stderr)
    _prepare_models(a.target_model, a.draft_model, a.draft_backend)
    print(f"specdec: starting redis, draft, target and coordinator{' and the OpenAI gateway' if stack.openai else ''} ...",
          file=sys.stderr)
    started = time.perf_counter()
    try:
        stack.up()
    except BaseException:
        _stop(stack)
        raise
    print(f"specdec: up in {time.perf_counter() - started:.0f} s; coordinator at {stack.address('coordinator')}, "
          f"redis at {stack.redis_url}" + (f", KV tier at {stack.kv_store_url}" if stack.kv_store_url else ""),
          file=sys.stderr)
    return stack


def _prepare_models(*refs: str) -> None:
    """Convert GGUF models once, in this process, so the services start from the converted copy."""
    from specdec_core.engine.models import resolve_model
    from specdec_core.engine.options import EngineOptions

    cache_dir = EngineOptions.from_env().cache_dir  # the workers' --cache-dir default
    target, draft, backend = refs
    resolve_model(target, cache_dir)
    if backend == "transformers":
        resolve_model(draft, cache_dir)


def cmd_up(a: argparse.Namespace) -> int:
    stack = _start_stack(a)
    print(f"specdec: try  specdec generate --address {stack.address('coordinator')} \"Hello!\"   (Ctrl-C stops)",
          file=sys.stderr)
    if stack.openai:
        print(f"specdec: OpenAI-compatible API at {stack.url()} (model: see {stack.url()}/models)", file=sys.stderr)
    try:
        while all(p.poll() is None for p in stack.processes.values()):
            time.sleep(0.5)
        dead = [n for n, p in stack.processes.items() if p.poll() is not None]
        print(f"specdec: {', '.join(dead)} exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        print(f"\nspecdec: {stop.args[0] if stop.args else 'interrupted'}; stopping", file=sys.stderr)
        return 0
    finally:
        _stop(stack)


def cmd_demo(a: argparse.Namespace) -> int:
    stack = _start_stack(a)
    try:
        with Client(stack.address("coordinator")) as client:
            return demo.run(client, a.prompt, _gen_kwargs(a))
    finally:
        _stop(stack)


def cmd_session(a: argparse.Namespace) -> int:
    with Client(a.address) as client:
        if a.action == "end":
            client.end_session(a.session_id)
            print(f"ended {a.session_id}")
        else:
            print(client.get_session(a.session_id))
    return 0


def cmd_loadtest(a: argparse.Namespace) -> int:
    from specdec.loadtest import run_cli

    return run_cli(a)


def cmd_models(a: argparse.Namespace) -> int:
    with Client(a.address) as client:
        print(client.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
