"""Model-free suffix drafting (SuffixDecoding, Oliaro et al., arXiv 2411.04975; vLLM's `suffix` method).

Like n-gram lookup it runs in the coordinator and costs no draft worker, but it looks beyond the
session: also at the tenant's previous requests (each finished one's prompt + output), which is what
pays on repetitive, agentic and templated traffic. A chain is proposed (no tree); the proposal is
deterministic, so when sampling it is sent one-hot, which keeps verification exact.

The rule, over one source at a time (the session's own tokens x[0..n), then the tenant's index):

    for each match length m, m_min <= m <= M, such that the suffix x[n-m..n) occurs in the source
    (on the ladder MATCH_RUNGS, each m raised to the shortest match among the occurrences it selects:
    the same occurrences, a longer K_m):
        O_m     = its occurrences (the most recent ones, see below); one that ends a sequence counts
                  too (the request ended there: its next token agrees with no proposal), the session's
                  own tail does not
        K_m     = min(K, floor(alpha * m))                  # the evidence buys the length
        walk:   at step j = 1, 2, ... take t_j, the most frequent next token among the occurrences
                that agree with t_1..t_{j-1}, and p_j = |O_m agreeing with t_1..t_j| / |O_m|, the
                path's empirical probability; stop before t_j if p_j < p_min, after K_m tokens,
                or when the occurrences run out (a sequence ends)
        score_m = sum_j p_j                                 # the path's expected accepted tokens
    propose the path of the highest score over all m and both sources; a tie goes to the longer match,
    then to the session's own tokens. Nothing is proposed below m_min or when p_1 < p_min.
    (K: the tokens asked for; M = max_match, 32; m_min = min_match, 2.)

So a shorter match that many occurrences agree on beats a longer, rarer one only when its path is
worth more accepted tokens. Among next tokens of equal count the most recent occurrence's wins
(n-gram lookup's rule). This is SuffixDecoding's path speculation (Arctic Inference's
`_speculate_path`) with m on a geometric ladder instead of every m.

Implementation, chosen by measurement (benchmarks/suffix_lookup.py): a source is a `bytes` tape of
4-byte tokens, sequences separated by SEP (never a token id), so no match spans two sequences. It
costs 4 bytes a token and an eviction is one slice, where a Python dict from 4-grams to positions
took 113 bytes a token (one n only) and a depth-8 trie 716 (tracemalloc, the benchmark's data).
Occurrences are found by `bytes.rfind` from the end (C speed, newest first) of the trailing
rungs[0], rungs[2], rungs[4]... tokens, up to `max_occurrences` each, until a search finds fewer
(it found them all, and every longer match among them); each occurrence's match length is then
found by slice equality, climbing the ladder and bisecting. |O_m| thus counts recent occurrences
only: a recency-weighted estimate. A lookup's cost is bounded by one tenant's tape, whatever the
size of the index.

Bounds (SuffixIndex): per tenant the most recent 256 sequences and 64k tokens, the oldest out first
(this bounds a lookup: p50 0.18 ms, p99 0.33 ms at full size, on a shared 2-core CPU), and 1M tokens
over all tenants (16 tenants at their bound), the least recently used tenant's oldest sequences out
first. At that full size the index holds 4.1 MB (tracemalloc, benchmarks/suffix_lookup.py), plus,
transiently, a copy of one tenant's tape while a sequence is added: the total bound could be raised
freely. One lock guards the index; lookups search immutable tapes outside it.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.loop import Draft
from coordinator.request import DEFAULT_TENANT, RequestContext
from specdec_core import metrics
from specdec_core.engine.grammar import Grammars
from specdec_core.engine.sampling import SamplingConfig

WIDTH = 4  # bytes a token on a tape (array typecode 'I')
SEP = 0xFFFFFFFF  # between sequences on a tape: never a token, so never matched nor proposed
SEP_BYTES = SEP.to_bytes(WIDTH, "little")
MATCH_RUNGS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # candidate match lengths (plus m_min)


def encode(token_ids: list[int]) -> bytes:
    """One sequence as a tape: SEP, its tokens, SEP."""
    return SEP_BYTES + array("I", token_ids).tobytes() + SEP_BYTES


@dataclass
class _Tenant:
    tape: bytes = SEP_BYTES  # SEP s_1 SEP s_2 SEP ... oldest first
    lengths: deque[int] = field(default_factory=deque)  # tokens of each sequence on the tape


class SuffixIndex:
    """Finished requests' tokens, one tape per tenant, bounded (see the module docstring). Thread-safe:
    one lock guards the tenants; a lookup gets an immutable tape and searches it without the lock."""

    def __init__(self, max_sequences: int = 256, max_tokens: int = 65536, max_total_tokens: int = 1 << 20):
        if min(max_sequences, max_tokens, max_total_tokens) < 1:
            raise ValueError("the suffix index's bounds must be positive")
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.max_total_tokens = max_total_tokens
        self._lock = threading.Lock()
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()  # least recently used first
        self._total = 0

    def add(self, tenant: str, token_ids: list[int]) -> None:
        """Index one finished request (prompt + output); a sequence over the bound keeps its end."""
        ids = list(token_ids[-self.max_tokens:])
        if not ids:
            return
        data = array("I", ids).tobytes() + SEP_BYTES
        with self._lock:
            entry = self._tenants.setdefault(tenant, _Tenant())
            self._tenants.move_to_end(tenant)
            held = len(entry.lengths) + 1 - self.max_sequences
            tokens = sum(entry.lengths) + len(ids) - self.max_tokens
            drop = self._drop_count(entry, held, tokens)
            entry.tape = self._cut(entry, drop) + data
            entry.lengths.append(len(ids))
            self._total += len(ids)
            self._evict_total()

    def tape(self, tenant: str) -> bytes:
        """The tenant's tape as it is now (immutable); the tenant becomes the most recently used."""
        with self._lock:
            entry = self._tenants.get(tenant)
            if entry is None:
                return SEP_BYTES
            self._tenants.move_to_end(tenant)
            return entry.tape

    def num_tokens(self, tenant: str | None = None) -> int:
        """Tokens held for one tenant, or for all of them."""
        with self._lock:
            if tenant is None:
                return self._total
            entry = self._tenants.get(tenant)
            return sum(entry.lengths) if entry else 0

    def num_sequences(self, tenant: str) -> int:
        with self._lock:
            entry = self._tenants.get(tenant)
            return len(entry.lengths) if entry else 0

    @staticmethod
    def _drop_count(entry: _Tenant, sequences: int, tokens: int) -> int:
        """How many of the oldest sequences to drop: at least `sequences`, and `tokens` tokens."""
        drop = 0
        for length in entry.lengths:
            if drop >= sequences and tokens <= 0:
                break
            drop, tokens = drop + 1, tokens - length
        return drop

    def _cut(self, entry: _Tenant, drop: int) -> bytes:
        """Drop the entry's `drop` oldest sequences (lock held); its tape without them."""
        cut = 0
        for _ in range(drop):
            length = entry.lengths.popleft()
            cut += length + 1
            self._total -= length
        return entry.tape[cut * WIDTH:]

    def _evict_total(self) -> None:
        """The total bound (lock held): the least recently used tenants' oldest sequences go first."""
        while self._total > self.max_total_tokens:
            name, entry = next(iter(self._tenants.items()))
            entry.tape = self._cut(entry, self._drop_count(entry, 0, self._total - self.max_total_tokens))
            if not entry.lengths:
                del self._tenants[name]


def occurrences(tape: bytes, pattern: bytes, end: int, limit: int) -> list[int]:
    """The next-token positions (in tokens) of the latest `limit` occurrences of pattern that lie in
    tape[:end] (bytes), newest first. Occurrences off the 4-byte grid are skipped."""
    found: list[int] = []
    while len(found) < limit:
        i = tape.rfind(pattern, 0, end)
        if i < 0:
            break
        if i % WIDTH == 0:
            found.append((i + len(pattern)) // WIDTH)
        end = i + len(pattern) - 1
    return found


def match_length(tape: bytes, pattern: bytes, pos: int, rungs: tuple[int, ...], rung: int) -> int:
    """How many tokens before pos equal the pattern's last ones, given that rungs[rung] do: climb the
    rungs, then bisect between the last equal one and the first unequal one (a longer equal suffix
    implies every shorter one)."""
    top = min(len(pattern) // WIDTH, pos)
    low, high = rungs[rung], top
    for length in rungs[rung + 1:]:
        if length > top or tape[(pos - length) * WIDTH:pos * WIDTH] != pattern[-length * WIDTH:]:
            high = min(length - 1, top)
            break
        low = length
    while low < high:
        mid = (low + high + 1) // 2
        if tape[(pos - mid) * WIDTH:pos * WIDTH] == pattern[-mid * WIDTH:]:
            low = mid
        else:
            high = mid - 1
    return low


def walk(tokens: memoryview, starts: list[int], max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path from the occurrences' next tokens: (its tokens, the sum of its empirical
    path probabilities). `starts` newest first: ties go to the most recent occurrence."""
    path: list[int] = []
    score, total, live = 0.0, len(starts), starts
    while len(path) < max_tokens:
        if len(live) == 1:  # one occurrence left: its tokens, up to its sequence's end
            prob = 1 / total
            if prob < min_prob:
                break
            rest = tokens[live[0]:live[0] + max_tokens - len(path)].tolist()
            rest = rest[:rest.index(SEP)] if SEP in rest else rest
            return path + rest, score + prob * len(rest)
        counts: dict[int, int] = {}
        for p in live:
            counts[tokens[p]] = counts.get(tokens[p], 0) + 1
        counts.pop(SEP, None)
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)
        prob = counts[best] / total
        if prob < min_prob:
            break
        path.append(best)
        score += prob
        live = [p + 1 for p in live if tokens[p] == best]
    return path, score


class SuffixProposer:
    """Proposes from the session's own tokens and its tenant's SuffixIndex (the module's rule).
    alpha = 2, min_prob = 0.2: on the synthetic replay of benchmarks/suffix_lookup.py --tune, the
    most tokens per verify cost at a GPU-like cost per proposed token (0.02 of a decoding step), and
    within 4% of the best at a CPU-like one (0.1). m_min = 2, n-gram lookup's minimum."""

    def __init__(self, index: SuffixIndex | None = None, max_match: int = 32, min_match: int = 2,
                 alpha: float = 2.0, min_prob: float = 0.2, max_occurrences: int = 16,
                 publish: Callable[[str, list[int]], None] | None = None, grammars: Grammars | None = None):
        if not 1 <= min_match <= max_match or max_occurrences < 1 or alpha <= 0:
            raise ValueError("need 1 <= min_match <= max_match, max_occurrences >= 1 and alpha > 0")
        self.index = index if index is not None else SuffixIndex()
        self.publish = publish  # tells the other coordinator replicas (coordinator/suffix_share.py)
        self.grammars = grammars  # cuts a constrained request's proposals where its constraint forbids
        self.max_match, self.min_match = max_match, min_match
        self.alpha, self.min_prob, self.max_occurrences = alpha, min_prob, max_occurrences
        self.rungs = tuple(sorted({min_match, *(r for r in MATCH_RUNGS if min_match < r <= max_match)}))

    def propose(self, ctx: RequestContext, committed_ids: list[int], num_tokens: int) -> Draft:
        """A greedy request drafts from its session and its tenant's index; a sampled one from its
        session alone, so that its seed gives the same tokens whatever else has finished (which
        positions were drafted decides which keyed draws make a sampled token)."""
        tokens = self.continuation(committed_ids, num_tokens, ctx.tenant, own_only=not ctx.sampling.is_greedy)
        tokens = self.allowed(ctx.sampling, committed_ids, tokens)
        dists = [] if ctx.sampling.is_greedy else [([t], [1.0]) for t in tokens]
        return Draft(tokens, dists, from_worker=False)

    def allowed(self, sampling: SamplingConfig, ids: list[int], tokens: list[int]) -> list[int]:
        """tokens, cut at the first one a constrained request's constraint forbids after ids."""
        if sampling.constraint is None or not tokens or self.grammars is None:
            return tokens
        return tokens[:self.grammars.allowed_prefix(sampling.constraint, ids[sampling.output_start:], tokens)]

    def continuation(self, ids: list[int], num_tokens: int, tenant: str = DEFAULT_TENANT, own_only: bool = False
                     ) -> list[int]:
        """What this proposer would propose after ids (the policy may score it on every round);
        own_only: from ids alone, not the tenant's index."""
        if num_tokens <= 0 or len(ids) < self.min_match:
            return []
        pattern = array("I", ids[-self.max_match:]).tobytes()
        own = encode(ids)
        best, best_score = self._best(own, pattern, len(own) - 2 * WIDTH, num_tokens)
        if own_only:
            return best
        tape = self.index.tape(tenant)
        path, score = self._best(tape, pattern, len(tape), num_tokens)
        return path if score > best_score else best

    def finished(self, tenant: str, token_ids: list[int]) -> None:
        """Index a finished request (its prompt + output) for the tenant's later requests, here and,
        with `publish`, on every replica."""
        self.index.add(tenant, token_ids)
        metrics.SUFFIX_INDEX_TOKENS.set(self.index.num_tokens())
        if self.publish is not None:
            self.publish(tenant, token_ids)

    def _best(self, tape: bytes, pattern: bytes, end: int, num_tokens: int) -> tuple[list[int], float]:
        """The highest-scoring continuation from one tape (only occurrences within tape[:end])."""
        found = self._occurrences(tape, pattern, end)
        tokens = memoryview(tape).cast("I")
        best: list[int] = []
        best_score, seen = 0.0, 0
        for rung in reversed(self.rungs):  # longest first: a tie keeps the longer match
            starts = sorted((p for p, length in found.items() if length >= rung), reverse=True)
            if not starts or len(starts) == seen:  # none, or the longer rung's again with a shorter cap
                continue
            seen = len(starts)
            match = min(found[p] for p in starts)  # m: these are the occurrences of its last m tokens
            cap = min(num_tokens, int(self.alpha * match + 1e-9))
            if cap <= best_score:  # a score is at most its length: no shorter match can win
                break
            path, score = walk(tokens, starts, cap, self.min_prob)
            if score > best_score:
                best, best_score = path, score
        return best, best_score

    def _occurrences(self, tape: bytes, pattern: bytes, end: int) -> dict[int, int]:
        """Next-token position -> match length, for the latest occurrences (at most
        max_occurrences each) of the trailing rungs[0], rungs[2], rungs[4]... tokens, in turn, until
        one finds fewer than that: it found them all, and the longer matches among them."""
        found: dict[int, int] = {}
        for rung in range(0, len(self.rungs), 2):
            length = self.rungs[rung]
            if length * WIDTH > len(pattern):
                break
            positions = occurrences(tape, pattern[-length * WIDTH:], end, self.max_occurrences)
            for p in positions:
                if p not in found:
                    found[p] = match_length(tape, pattern, p, self.rungs, rung)
            if len(positions) < self.max_occurrences:
                break
        return found
