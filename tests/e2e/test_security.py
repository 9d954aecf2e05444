"""Security of a running stack: TLS and bearer tokens on the public endpoint, mutual TLS between the
coordinator and the workers, plaintext health ports for probes, and no prompt text or token in the
logs.

A throwaway PKI is made with the `openssl` CLI: a CA, a server certificate for the coordinator (SAN
IP 127.0.0.1 and DNS localhost), a server certificate for the workers (DNS name only, so that the
coordinator must use --worker-tls-server-name), a client certificate for the coordinator, and a
rogue CA with its own client certificate.

`Stack.up()` waits for health on each service's main port in plaintext, which cannot work with TLS
on; the services are started with `Stack.start(name, wait_s=0)` and their plaintext --health-port
polled instead.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pki import make_ca, make_leaf
from stacks import status_of
from specdec import Client
from specdec.client import build_input
from specdec.launcher import Stack, free_port, wait_serving
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.v1 import generation_pb2 as pb

pytestmark = [pytest.mark.security, pytest.mark.e2e]

WORKER_NAME = "specdec-worker.internal"
TOKENS = ["tok-alpha-7f3e0c2b9d41a655", "tok-beta-31c9d0aa4e8b2f07"]
WRONG_TOKEN = "tok-wrong-5b1e88c0d2f94a13"
SECRET = "zebra-unicorn-9431"
IDS = [504, 3458, 282, 4649, 314]


# ---- a throwaway PKI ---------------------------------------------------------------------------

def make_pki(d: Path) -> Path:
    make_ca(d, "ca")
    make_leaf(d, "coordinator", "ca", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    make_leaf(d, "worker", "ca", "serverAuth", f"DNS:{WORKER_NAME}")
    make_leaf(d, "coordinator-client", "ca", "clientAuth")
    make_ca(d, "rogue-ca")
    make_leaf(d, "rogue-client", "rogue-ca", "clientAuth")
    return d


# ---- the stack ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_stack(tiny_pair, pki, tmp_path_factory):
    tokens_file = pki / "tokens"
    tokens_file.write_text("\n".join(TOKENS) + "\n")
    health = {name: free_port() for name in ("draft", "target", "coordinator")}
    worker_tls = ["--tls-cert", str(pki / "worker.crt"), "--tls-key", str(pki / "worker.key"),
                  "--tls-client-ca", str(pki / "ca.crt")]
    stack = Stack(target_model=tiny_pair[0], draft_model=tiny_pair[1], log_dir=tmp_path_factory.mktemp("logs"), args={
        "draft": [*worker_tls, "--health-port", str(health["draft"])],
        "target": [*worker_tls, "--health-port", str(health["target"])],
        "coordinator": [
            "--tls-cert", str(pki / "coordinator.crt"), "--tls-key", str(pki / "coordinator.key"),
            "--auth-tokens-file", str(tokens_file), "--health-port", str(health["coordinator"]),
            "--worker-tls-cert", str(pki / "coordinator-client.crt"),
            "--worker-tls-key", str(pki / "coordinator-client.key"),
            "--worker-tls-ca", str(pki / "ca.crt"), "--worker-tls-server-name", WORKER_NAME,
        ],
    })
    stack.health_ports = health
    try:
        stack.start_redis()
        for name in ("draft", "target"):
            stack.start(name, wait_s=0)
        for name in ("draft", "target"):
            wait_serving(f"127.0.0.1:{health[name]}", 300, stack.processes[name], name)
        stack.start("coordinator", wait_s=0)
        wait_serving(f"127.0.0.1:{health['coordinator']}", 300, stack.processes["coordinator"], "coordinator")
    except BaseException:
        stack.down()
        for log in stack.log_dir.glob("*.log"):
            print(f"==== {log.name}\n{log.read_text()[-3000:]}")
        raise
    yield stack
    stack.down()


def tls(pki: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def client(secure_stack, pki):
    with Client(secure_stack.address("coordinator"), credentials=tls(pki)) as c:
        yield c


def generate(client: Client, prompt, metadata=None, **kwargs) -> pb.GenerateResponse:
    return client.stub.Generate(pb.GenerateRequest(input=build_input(prompt, **kwargs)), metadata=metadata,
                                timeout=120)


def stream(client: Client, prompt, metadata=None, **kwargs) -> list[pb.GenerateStreamResponse]:
    return list(client.stub.GenerateStream(pb.GenerateStreamRequest(input=build_input(prompt, **kwargs)),
                                           metadata=metadata, timeout=120))


# ---- a. TLS + the right token ------------------------------------------------------------------

def test_tls_client_with_token_generates(secure_stack, pki, client, hf_greedy):
    chunks = stream(client, IDS, bearer(TOKENS[0]), max_new_tokens=24, k=4, overlap=False)  # rounds wait for drafts
    ids = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(chunks) > 1
    assert ids == hf_greedy(IDS, 24)
    assert chunks[-1].stats.drafted > 0  # the coordinator reached the draft over mutual TLS too
    # Any token from the file; lower-case scheme; the DNS name in the certificate.
    again = generate(client, IDS, [("authorization", f"bearer {TOKENS[1]}")], max_new_tokens=24, k=4)
    assert list(again.token_ids) == ids
    with Client(f"localhost:{secure_stack.ports['coordinator']}", credentials=tls(pki)) as by_name:
        assert len(generate(by_name, "Hello", bearer(TOKENS[0]), max_new_tokens=3).token_ids) == 3


def test_client_library_sends_the_token(secure_stack, pki, hf_greedy):
    address = f"127.0.0.1:{secure_stack.ports['coordinator']}"
    with Client(address, tls_ca=str(pki / "ca.crt"), token=TOKENS[0], timeout_s=60) as good:
        assert good.generate(IDS, max_new_tokens=8, k=4).token_ids == hf_greedy(IDS, 8)
        assert [t for c in good.stream(IDS, max_new_tokens=8) for t in c.token_ids] == hf_greedy(IDS, 8)
    with Client(address, tls_ca=str(pki / "ca.crt"), token="wrong", timeout_s=60) as bad:
        with pytest.raises(grpc.RpcError) as err:
            bad.generate(IDS, max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- b. plaintext is refused -------------------------------------------------------------------

def test_plaintext_client_fails(secure_stack):
    with Client(secure_stack.address("coordinator"), timeout_s=10) as plain:
        code, details = status_of(lambda: plain.stub.Generate(
            pb.GenerateRequest(input=build_input(IDS, max_new_tokens=2)), metadata=bearer(TOKENS[0]), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        code, details = status_of(lambda: list(plain.stub.GenerateStream(
            pb.GenerateStreamRequest(input=build_input(IDS, max_new_tokens=2)), metadata=bearer(TOKENS[0]),
            timeout=10)))
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)


# ---- c. no token, a wrong token ----------------------------------------------------------------

@pytest.mark.parametrize("metadata", [
    None,
    bearer(WRONG_TOKEN),
    bearer(""),
    bearer(TOKENS[0][:-1]),  # a prefix of a good token
    bearer(TOKENS[0] + "x"),
    [("authorization", TOKENS[0])],  # no scheme
    [("authorization", f"Basic {TOKENS[0]}")],
    [("x-api-key", TOKENS[0])],
], ids=["missing", "wrong", "empty", "prefix", "longer", "no-scheme", "basic", "other-header"])
def test_missing_or_wrong_token_is_unauthenticated(client, metadata):
    calls = {
        "Generate": lambda: generate(client, IDS, metadata, max_new_tokens=2),
        "GenerateStream": lambda: stream(client, IDS, metadata, max_new_tokens=2),
        "GetSession": lambda: client.stub.GetSession(pb.GetSessionRequest(session_id="x"), metadata=metadata,
                                                     timeout=10),
        "EndSession": lambda: client.stub.EndSession(pb.EndSessionRequest(session_id="x"), metadata=metadata,
                                                     timeout=10),
        "DescribeModels": lambda: client.stub.DescribeModels(pb.DescribeModelsRequest(), metadata=metadata,
                                                             timeout=10),
    }
    for method, call in calls.items():
        code, details = status_of(call)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
        assert "token" in details, details


# ---- d. health needs no token ------------------------------------------------------------------

def health_status(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_without_token(secure_stack, pki):
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(secure_stack.address("coordinator"), tls(pki)) as ch:
        assert health_status(ch) == serving
        assert health_status(ch, "specdec.v1.Generation") == serving
    for name, port in secure_stack.health_ports.items():  # the plaintext probe ports
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert health_status(ch) == serving, name


# ---- e. the workers require the coordinator's client certificate -------------------------------

WORKER_CALLS = {
    "target": lambda ch: target_pb2_grpc.TargetStub(ch).GetTargetModel(target_pb2.GetTargetModelRequest(), timeout=10),
    "draft": lambda ch: draft_pb2_grpc.DraftStub(ch).GetDraftModel(draft_pb2.GetDraftModelRequest(), timeout=10),
}


def test_workers_require_client_certificate(secure_stack, pki):
    name_override = [("grpc.ssl_target_name_override", WORKER_NAME)]
    ca = (pki / "ca.crt").read_bytes()
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
    rogue = grpc.ssl_channel_credentials(root_certificates=ca,
                                         private_key=(pki / "rogue-client.key").read_bytes(),
                                         certificate_chain=(pki / "rogue-client.crt").read_bytes())
    good = grpc.ssl_channel_credentials(root_certificates=ca,
                                        private_key=(pki / "coordinator-client.key").read_bytes(),
                                        certificate_chain=(pki / "coordinator-client.crt").read_bytes())
    for role, call in WORKER_CALLS.items():
        address = secure_stack.address(role)
        for what, credentials in (("no client certificate", no_cert), ("a rogue CA's certificate", rogue)):
            with grpc.secure_channel(address, credentials, options=name_override) as ch:
                code, details = status_of(lambda: call(ch))
                assert code == grpc.StatusCode.UNAVAILABLE, (role, what, code, details)
        with grpc.insecure_channel(address) as ch:
            code, details = status_of(lambda: call(ch))
            assert code == grpc.StatusCode.UNAVAILABLE, (role, "plaintext", code, details)
        with grpc.secure_channel(address, good, options=name_override) as ch:
            info = call(ch).model
            assert info.vocab_size == 49152, role


# ---- f. no prompt text and no token in the logs ------------------------------------------------

def test_logs_hold_no_prompt_text_nor_token(secure_stack, client):
    token = bearer(TOKENS[1])
    text = f"Please remember the password {SECRET} and repeat it."
    generate(client, text, token, max_new_tokens=8, k=4)
    stream(client, [{"role": "user", "content": text}], token, max_new_tokens=8, k=4)
    first = generate(client, text, token, max_new_tokens=4)
    generate(client, text, token, max_new_tokens=4, session_id=first.session_id, stop=[SECRET])
    for bad in ({"temperature": 1.0, "top_p": 1.5}, {"stop": [""]}, {"max_new_tokens": 10**6}):
        code, _ = status_of(lambda: generate(client, text, token, **bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    status_of(lambda: generate(client, text, bearer(WRONG_TOKEN), max_new_tokens=2))
    status_of(lambda: generate(client, text, bearer(TOKENS[0] + SECRET), max_new_tokens=2))
    time.sleep(0.5)
    logs = {p.name: p.read_text(errors="replace") for p in secure_stack.log_dir.glob("*.log")}
    assert set(logs) >= {"coordinator.log", "draft.log", "target.log"}
    assert "serving specdec.v1.Generation" in logs["coordinator.log"]  # the logs are real and being written
    for name, content in logs.items():
        for secret in (SECRET, *TOKENS, WRONG_TOKEN):
            assert secret not in content, f"{secret!r} appears in {name}"



# ---- the OpenAI-compatible API over TLS ---------------------------------------------------------

@pytest.mark.openai
def test_openai_gateway_serves_https_over_a_tls_coordinator(secure_stack, pki, client):
    """The gateway serves HTTPS with the public certificate, checks the coordinator's certificate
    against the CA, and passes the bearer token on: the coordinator's own auth decides."""
    import ssl

    import openai

    secure_stack.args["openai"] = ["--tls-cert", str(pki / "coordinator.crt"), "--tls-key", str(pki / "coordinator.key"),
                                   "--coordinator-tls-ca", str(pki / "ca.crt"), "--coordinator-server-name", "localhost"]
    secure_stack.start("openai", wait_s=60)
    try:
        assert secure_stack.url().startswith("https://")

        def sdk(token: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=secure_stack.url(), api_key=token, max_retries=0, timeout=60,
                                 http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(pki / "ca.crt"))))

        good = sdk(TOKENS[0])
        model = good.models.list().data[0].id
        r = good.completions.create(model=model, prompt=IDS, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == generate(client, IDS, bearer(TOKENS[0]), max_new_tokens=8).token_ids
        with pytest.raises(openai.AuthenticationError):
            sdk("not-a-token").completions.create(model=model, prompt=IDS, max_tokens=2)
        with pytest.raises(openai.APIConnectionError):  # the certificate is checked: an unknown CA fails
            openai.OpenAI(base_url=secure_stack.url(), api_key=TOKENS[0], max_retries=0, timeout=10).models.list()
    finally:
        secure_stack.stop("openai")
