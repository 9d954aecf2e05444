"""The EAGLE-3 head in the target worker: it follows every session's committed tokens with the
target's own features, and after a verdict proposes the next round's draft, so that a head round is
one Verify call (the proposal travels back with the verdict).

- Features: the backend records, in every pass, the residual stream entering the head's three layers
  for every token it feeds (`BatchedBackend.capture`). After the pass (and the verdict's crop), the
  session's head absorbs the new pairs (g_i, x_{i+1}) for the positions i the target's cache now
  holds: one head-layer pass over them (a prompt's prefill: one pass over the prompt).
- Its cache lives on the session's `CachedSequence` (`seq.head`), so it is evicted, released and
  reset with the target's cache. The pairs it holds are checked against the committed tokens on each
  pass: pairs whose next token changed are dropped; positions the target got without computing them
  (a shared prefix, a restore from the KV tier) leave a gap, and the head starts again after it
  (`HeadState.offset`). None of this can change an output, only how good the proposals are.
- Proposals: draft-vocabulary logits are put back into the target's vocabulary (the other tokens at
  -inf), processed exactly as the target's (penalties, bias, the constraint's mask; temperature,
  top-k, top-p when sampling), then argmax, or a keyed draw at the token's position (Purpose.DRAFT)
  from the processed distribution truncated to `sparse_top`, which is sent as q: the accept rule
  is the draft model's, so sampled output keeps the target's exact distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec_core import metrics
from specdec_core.engine.grammar import Grammars
from specdec_core.engine.sampling import SamplingConfig, SparseDist, adjust_logits, draw_draft
from specdec_core.errors import SpecdecError
from target_service.head import Eagle3Head, HeadState


MAX_PENDING = 4096  # target features a session keeps for its head before it asks for a proposal (7 KB each here)


class Rows:
    """Feature rows waiting for the head, kept as the passes' chunks: a round appends its rows and
    nothing is copied until the head takes them (one concatenation, then)."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def append(self, rows: torch.Tensor) -> None:
        if len(rows):
            self.chunks.append(rows)
            self.count += len(rows)

    def keep_first(self, n: int) -> None:
        while self.count > n:
            last = self.chunks.pop()
            self.count -= len(last)
            if self.count < n:
                self.append(last[:n - self.count])

    def drop_first(self, n: int) -> None:
        while n > 0 and self.chunks:
            first = self.chunks.pop(0)
            self.count -= len(first)
            if len(first) > n:
                self.chunks.insert(0, first[n:])
                self.count += len(first) - n
            n -= len(first)

    def first(self, n: int) -> torch.Tensor:
        whole = torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [whole]
        return whole[:n]


@dataclass
class HeadSession:
    state: HeadState
    tokens: list[int]  # x_{i+1} of each committed pair, in order (pair j is i = state.offset + j)
    pending: Rows = field(default_factory=Rows)  # g rows of the positions after the pairs, not absorbed yet


class HeadDrafter:
    def __init__(self, head: Eagle3Head, vocab_size: int, sparse_top: int = 64, grammars: Grammars | None = None):
        self.head = head
        self.vocab_size = vocab_size
        self.sparse_top = sparse_top
        self.grammars = grammars
        self.layer_ids = tuple(head.config.aux_layer_ids)
        self._targets = head.to_target(torch.arange(head.config.draft_vocab_size))  # draft id -> target id

    def absorb(self, seq, fed_start: int, aux: torch.Tensor, known_ids: list[int], now: bool = False) -> None:
        """After a pass that fed the session's positions fed_start.. (features `aux`, one row each):
        keep the features of the positions its target cache now holds, and with `now` (a proposal
        follows) let the head take the pairs (g_i, x_{i+1}) of all of them, x from known_ids (the
        committed tokens, the verdict's included). Until a session asks for a proposal its features
        only wait (at most MAX_PENDING positions, the latest), so sessions that never draft with the
        head pay no head pass."""
        started = time.perf_counter()
        session = seq.head
        if session is None:
            session = seq.head = HeadSession(self.head.new_state(64), [])
        state = session.state
        # the pairs that are still true: below fed_start (their g is still the cache's) and whose
        # next token is still the committed one
        keep, limit = 0, min(state.committed, fed_start - state.offset)
        while keep < limit and session.tokens[keep] == known_ids[state.offset + keep + 1]:
            keep += 1
        pending = session.pending
        if keep < state.committed:
            self.head.rollback(state, keep)
            del session.tokens[keep:]
            pending.keep_first(0)
        covered = state.offset + state.committed
        pending.keep_first(max(0, fed_start - covered))  # rows of positions the cache still holds
        if covered + len(pending) < fed_start:  # a gap (positions the target did not compute here): start after it
            self._restart(session, fed_start)
            covered = fed_start
        pending.append(aux[:max(0, len(seq.token_ids) - fed_start)])
        if len(pending) > MAX_PENDING:  # the oldest go: the head starts after them
            drop = len(pending) - MAX_PENDING
            pending.drop_first(drop)
            self._restart(session, covered + drop, keep_pending=True)
            covered = state.offset
        if now:
            n = min(len(pending), len(known_ids) - 1 - covered)  # pairs whose next token is known
            if n > 0:
                self.head.extend(state, pending.first(n), torch.tensor(known_ids[covered + 1:covered + 1 + n]))
                session.tokens.extend(known_ids[covered + 1:covered + 1 + n])
                pending.drop_first(n)
        metrics.HEAD_SECONDS.labels("absorb").inc(time.perf_counter() - started)

    def _restart(self, session: HeadSession, offset: int, keep_pending: bool = False) -> None:
        self.head.rollback(session.state, 0)
        session.tokens.clear()
        if not keep_pending:
            session.pending.keep_first(0)
        session.state.offset = offset

    def propose(self, seq, committed_ids: list[int], k: int, sampling: SamplingConfig, seed: int
                ) -> tuple[list[int], list[SparseDist]]:
        """Up to k draft tokens after committed_ids (whose last token is the verdict's), and when
        sampling the distribution each was drawn from. Nothing when the head does not follow the
        session up to its last token."""
        session = seq.head
        if k <= 0 or session is None or session.state.last is None:
            return [], []
        state = session.state
        if state.offset + state.committed != len(committed_ids) - 1:
            return [], []
        started = time.perf_counter()
        tokens: list[int] = []
        dists: list[SparseDist] = []
        hidden, logits = self.head.output(state)
        try:
            for j in range(k):
                token, dist = self._choose(logits[0], sampling, committed_ids + tokens, seed, len(committed_ids) + j)
                if token is None:  # the constraint allows none of the draft vocabulary here
                    break
                tokens.append(token)
                if dist is not None:
                    dists.append(dist)
                if j + 1 < k:
                    hidden, logits = self.head.step(state, hidden, torch.tensor(token))
        except SpecdecError:  # its constraint forbids going on here: the proposal ends
            pass
        metrics.HEAD_SECONDS.labels("propose").inc(time.perf_counter() - started)
        metrics.HEAD_TOKENS.inc(len(tokens))
        return tokens, dists

    def _choose(self, draft_logits: torch.Tensor, cfg: SamplingConfig, context: list[int], seed: int,
                position: int) -> tuple[int | None, SparseDist | None]:
        if cfg.is_greedy and not cfg.adjusts_logits:  # the draft vocabulary's argmax is the answer
            return int(self._targets[int(draft_logits.argmax())]), None
        full = torch.full((1, self.vocab_size), float("-inf"), dtype=torch.float32)
        full[0, self._targets] = draft_logits.float()
        full = adjust_logits(full, cfg, context if cfg.adjusts_logits else (), self.grammars)
        if not torch.isfinite(full.max()):
            return None, None
        if cfg.is_greedy:
            return int(full[0].argmax()), None
        return draw_draft(full[0], cfg, seed, position, self.sparse_top)
