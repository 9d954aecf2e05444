"""A generation shown on a terminal: its text streamed to stdout, its stats as one line."""

from __future__ import annotations

import sys
import time

from specdec.client import Client, stats_dict
from specdec.v1 import generation_pb2 as pb


def stream_to_terminal(client: Client, prompt, quiet: bool = False, **kwargs) -> dict:
    """Stream a generation to stdout; return its stats, its token_ids and client-side timings
    (decode_tokens_per_s: the tokens after the first chunk over the time after it, prefill excluded)."""
    started = time.perf_counter()
    first = None  # when the first tokens arrived
    first_chunk_tokens = 0
    last = None
    token_ids: list[int] = []
    for chunk in client.stream(prompt, **kwargs):
        if first is None and chunk.token_ids:
            first, first_chunk_tokens = time.perf_counter(), len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        print(chunk.text, end="", flush=True)
        last = chunk
    wall = time.perf_counter() - started
    ttft = (first or started) - started
    print()
    stats = stats_dict(last.stats)
    stats.update(session_id=last.session_id, completion_tokens=last.usage.completion_tokens,
                 finish_reason=pb.FinishReason.Name(last.finish_reason), client_wall_s=wall,
                 ttft_ms=ttft * 1e3, token_ids=token_ids,
                 tokens_per_s=last.usage.completion_tokens / wall if wall > 0 else 0.0,
                 decode_tokens_per_s=(len(token_ids) - first_chunk_tokens) / (wall - ttft) if wall > ttft else 0.0)
    if not quiet:
        print(format_stats(stats), file=sys.stderr)
    return stats


def format_stats(s: dict) -> str:
    return (f"[{s['completion_tokens']} tokens in {s['client_wall_s']:.2f} s = {s['tokens_per_s']:.1f} tok/s | "
            f"TTFT {s['ttft_ms']:.0f} ms | rounds {s['rounds']}"
            f"{f' + {d} decoded' if (d := s.get('decoded')) else ''} | acceptance {s['acceptance_rate']:.0%} "
            f"({s['accepted']}/{s['drafted']}) | {s['mean_accepted_length']:.2f} tokens/round | "
            f"draft {s['draft_ms']:.0f} ms, verify {s['verify_ms']:.0f} ms, other {s['overhead_ms']:.0f} ms | "
            f"{s['finish_reason'].removeprefix('FINISH_REASON_').lower()} | session {s['session_id']}]")
