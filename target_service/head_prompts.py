"""Chat prompts for training an EAGLE-3 draft head by self-distillation, built offline.

The target model answers these prompts and the head learns from its answers, so the prompts only need to look
like what users send a small chat model. Their text is mined from what is already on this machine (no network,
no data set download):

* ``*.dist-info/METADATA`` of the installed Python packages: their long descriptions are READMEs (paragraphs,
  headings, list items) and their ``Summary`` lines say what each package is for;
* docstrings of safe standard-library modules (json, re, pathlib, ...) read with ``inspect``: their first lines
  become coding tasks ("Write a Python function that returns ...");
* README/markdown/text files under ``/usr/share/doc``.

Snippets are cleaned (markdown/RST links, images, badges, HTML and code dropped), kept only when they look like
English prose, deduplicated, and poured into templates of several kinds (summarize, explain, rewrite, answer in
JSON, open questions on a topic, coding tasks, ...). The project's benchmark prompts are never a source; to
guarantee that none leaks into training, pass ``benchmark_exclusions()`` as ``exclude``.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import importlib.util
import inspect
import random
import re
import sys
import warnings
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STDLIB = ("json os os.path re collections itertools functools pathlib datetime argparse string textwrap math "
          "statistics random heapq bisect shutil glob fnmatch csv hashlib base64 urllib.parse html difflib operator "
          "dataclasses enum fractions decimal calendar time uuid io zipfile tarfile gzip copy pprint logging "
          "contextlib secrets struct tempfile sqlite3 array queue threading subprocess shlex").split()
SKIP_DISTS = {"specdec"}  # the project's own README, which talks about its benchmarks
PER_OWNER = 400  # blocks read per package or /usr/share/doc folder: no single manual drowns the rest
GENERIC = set("installation install usage license changelog contributing features example examples documentation "
              "overview introduction contents requirements credits authors links support quickstart development "
              "testing tests news history description notes faq summary api references issues include compatibility "
              "acknowledgements acknowledgments thanks".split())
VERBS = set("return set encode decode change get create copy convert execute perform remove read call wait parse "
            "compare represent write force find insert serialize deserialize truncate initialize open rename delete "
            "compile escape try clear make choose generate transform pop push replace close build split join load "
            "save add check compute calculate count format apply sort test update construct determine extract filter "
            "merge normalize print register search match translate validate unpack pack iterate collect wrap fill "
            "strip quote unquote resolve move list send receive start stop run show emit handle process evaluate "
            "compress decompress shuffle round select raise reset skip append".split())
STOP = set("the a an to of and is in for with you this it that are be".split())
MARKUP = [(r"\[!\[.*?\]\(.*?\)\]\(.*?\)", ""), (r"!\[[^\]]*\]\([^)]*\)", ""), (r"`([^`<]+?)\s*<[^>]*>`__?", r"\1"),
          (r"<[^>]+>", ""), (r"\[([^\]]*)\]\([^)]*\)", r"\1"), (r"\[([^\]]+)\]\[[^\]]*\]", r"\1"),
          (r":[\w:+-]+:`([^`]*)`", r"\1"), (r"\|[\w -]+\|_?", ""), (r"https?://\S+", ""), (r"`+", ""),
          (r"\*\*|(?<!\w)[*_](?=\w)|(?<=\w)[*_](?!\w)", ""), (r"&\w+;", " "), (r"\s+", " ")]


def _clean(text: str) -> str:
    """Markdown/RST/HTML markup (links, images, badges, roles, emphasis) removed, whitespace collapsed."""
    for pat, rep in MARKUP:
        text = re.sub(pat, rep, text)
    return text.strip(" -:")


def _english(text: str, lo: int = 40, hi: int = 600) -> bool:
    """Prose of the right length: ASCII, mostly letters, some common English words, no code-like symbols."""
    if not lo <= len(text) <= hi or not text.isascii() or re.search(r"[{}<>\\|=#@$;]|\(\)|\.\w+\(|__", text):
        return False
    words = re.findall(r"[a-z']+", text.lower())
    return sum(c.isalpha() or c == " " for c in text) >= 0.85 * len(text) and len(STOP.intersection(words)) >= 2


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)
            if s[0].isupper() and s[-1] in ".!?" and len(s.split()) >= 6 and _english(s, 30, 250)]


def _topic(heading: str) -> str | None:
    """A heading or summary usable as "Give three tips about <topic>", or None."""
    h = _clean(heading).strip(" .:!?")
    if (" " in h and all(w[1:].islower() or len(w) == 1 for w in h.split())) or (h.isupper() and len(h) > 5):
        h = h.lower()  # "Error Handling", "REFERENCES"
    ok = 3 <= len(h) <= 60 and len(h.split()) <= 7 and h.isascii() and h[0].isalpha() and h.lower() not in GENERIC
    ok = ok and not re.search(r"[()\[\]{}_=/<>]|\w\.\w", h)
    return h if ok and sum(c.isalpha() or c == " " for c in h) >= 0.85 * len(h) else None


def _parse(text: str, corpus: dict, source: str, owner: str) -> None:
    """Paragraphs, list items, sentences and heading topics of a markdown/RST/plain document into `corpus`."""
    text = re.sub(r"(?s)<!--.*?-->|```.*?```|~~~.*?~~~", "\n\n", text.replace("\r", ""))
    text = re.sub(r"(?<=[a-z])-\n\s*(?=[a-z])", "", text)  # "neces-\n   sary" in formatted manuals
    for block in re.split(r"\n\s*\n", text):
        corpus["owners"][owner] = corpus["owners"].get(owner, 0) + 1
        if corpus["owners"][owner] > PER_OWNER:
            return
        raw = [ln for ln in block.split("\n") if ln.strip()]
        if not raw or any(ln.startswith(("    ", "\t", ">>>", "$ ", "..", "|", "+-")) for ln in raw):
            continue  # code, doctests, directives, tables
        lines = [ln.strip() for ln in raw]
        if lines[0].startswith("#") or (len(lines) in (2, 3) and re.fullmatch(r"([=\-~^*\"+])\1{2,}", lines[-1])):
            heading = lines[0].lstrip("# ") if lines[0].startswith("#") else lines[-2]
            corpus["topics"].add((_topic(heading), owner))
            corpus["count"][source] += 1
            lines = lines[1:] if lines[0].startswith("#") else []
        bullet = r"(?:[-*+]|\d+[.)])\s+"
        items = re.split("\n" + bullet, "\n" + "\n".join(lines)) if lines and re.match(bullet, lines[0]) else lines
        for item in items if items is not lines else [" ".join(lines)]:
            p = _clean(item)
            if _english(p) and (p[-1] in ".!?:" or len(p) > 120):
                corpus["paragraphs"].add((p, owner))
                corpus["sentences"].update((s, owner) for s in _sentences(p))
                corpus["count"][source] += 1


def _metadata(corpus: dict) -> None:
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        msg = Parser().parsestr(meta.read_text(errors="replace"))
        name, summary = msg.get("Name", ""), _clean(msg.get("Summary") or "").rstrip(".")
        if not name or name.lower() in SKIP_DISTS:
            continue
        if summary.isascii() and len(summary.split()) >= 2:
            corpus["packages"].add((name, summary))
            corpus["count"]["metadata"] += 1
        _parse(msg.get_payload() or msg.get("Description") or "", corpus, "metadata", name)


def _stdlib(corpus: dict) -> None:
    for modname in STDLIB:
        mod = importlib.import_module(modname)
        members = [(f"{modname}.{n}", o) for n, o in inspect.getmembers(mod) if not n.startswith("_") and callable(o)]
        members += [(f"{q}.{n}", o) for q, c in members if inspect.isclass(c)
                    for n, o in vars(c).items() if not n.startswith("_") and callable(o)]
        for qual, obj in members:
            doc = getattr(obj, "__doc__", None)
            paras = [_clean(p) for p in (inspect.cleandoc(doc) if isinstance(doc, str) else "").split("\n\n")
                     if not re.match(r"\s*[\w.]+\(", p)]  # not a signature line
            if paras and 15 <= len(paras[0]) <= 160 and paras[0].isascii():
                corpus["functions"].add((qual, paras[0].split(". ")[0].rstrip(".")))
                corpus["count"]["stdlib"] += 1
            for p in filter(_english, paras[1:]):
                corpus["paragraphs"].add((p, qual))
                corpus["sentences"].update((s, qual) for s in _sentences(p))
                corpus["count"]["stdlib"] += 1


def _usr_share_doc(corpus: dict) -> None:
    wanted, unwanted = re.compile(r"^readme|\.(md|txt|rst|markdown)(\.gz)?$", re.I), re.compile(
        r"change|news|copyright|licen[cs]e|test", re.I)
    for f in sorted(Path("/usr/share/doc").rglob("*")):
        if wanted.search(f.name) and not unwanted.search(f.name) and f.is_file():
            raw = (gzip.open if f.suffix == ".gz" else open)(f, "rb").read(200_000)
            _parse(raw.decode("utf-8", "replace"), corpus, "usr_share_doc", f.relative_to("/usr/share/doc").parts[0])


@functools.lru_cache(maxsize=1)
def _corpus() -> dict:
    corpus = {k: set() for k in ("paragraphs", "sentences", "topics", "packages", "functions")}
    corpus |= {"count": {"metadata": 0, "stdlib": 0, "usr_share_doc": 0}, "owners": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for build in (_metadata, _stdlib, _usr_share_doc):
            try:
                build(corpus)
            except OSError:  # a source this machine lacks
                pass
    corpus["topics"] = {(t, o) for t, o in corpus["topics"] if t}
    corpus["topics"] |= {(s.lower() if " " in s else s, n) for n, s in corpus["packages"] if _topic(s)}
    return {k: sorted(v) if isinstance(v, set) else v for k, v in corpus.items()}


def sources() -> dict[str, int]:
    """How many raw snippets (paragraphs, headings, summaries, docstrings) each source produced."""
    return dict(_corpus()["count"])


def _task(line: str) -> str | None:
    """A docstring's first line ("Return the ...") as the rest of "Write a Python function that ...", or None."""
    word, _, rest = line.partition(" ")
    w = word.lower()
    if w in VERBS:
        w = w[:-1] + "ies" if re.search(r"[^aeiou]y$", w) else w + ("es" if re.search(r"(s|sh|ch|x)$", w) else "s")
    elif not (w.endswith("s") and (w[:-1] in VERBS or w[:-2] in VERBS)):
        return None
    return f"{w} {rest}".strip()


FIELDS = ['"topic", "summary" and "keywords"', '"title" and "tags"', '"subject", "claim" and "confidence"',
          '"name", "description" and "category"']
KINDS = {  # kind: (corpus part of (s, o) pairs, weight, templates); {t} is o as a coding task, {l} s lowercased
    "summarize": ("paragraphs", 3, [
        "Summarize the following text:\n\n{s}", "Summarize this in one sentence: {s}", "TL;DR: {s}",
        "{s}\n\nWhat is the main idea of this paragraph?", "Read this and list the key points:\n{s}",
        "Explain this to a beginner:\n\n{s}", "Write a short title for this text: {s}"]),
    "explain": ("sentences", 2, ["Explain in simple terms: {s}", "What does this mean? \"{s}\"", "Paraphrase: {s}",
                                 "Is this statement correct? {s}", "Explain like I'm five: {s}"]),
    "rewrite": ("sentences", 2, ["Rewrite this sentence more clearly: {s}", "Make this sentence shorter: {s}",
                                 "Rewrite this in a friendly tone: {s}", "Fix the grammar and style: {s}",
                                 "Translate to French: {s}"]),
    "json": ("sentences", 1, [f"Answer with a JSON object with fields {f} about: {{s}}" for f in FIELDS]),
    "context": ("sentences", 2, [
        "I'm reading about {o}. It says: \"{s}\" Can you explain what that means?",
        "My friend told me that {l} I don't get it. Why would that be useful?",
        "Here is a sentence from the {o} docs: {s} What questions should I ask to understand it better?"]),
    "topic": ("topics", 3, [
        "Give three tips about {s}.", "Write a short paragraph about {s}.", "Why is {s} important?",
        "What are the pros and cons of {s}?", "Write a haiku about {s}.", "List five facts about {s}.",
        "How would you explain {s} to a new programmer?", "What are common mistakes with {s}?",
        "Write a tweet about {s}.", "Can you give me an example of {s}?", "Tell me a fun fact about {s}."]),
    "short": ("topics", 2, ["What is {s}?", "Define {s}.", "Who uses {s}?", "{s}: what is it for?",
                            "Is {s} hard to learn?"]),
    "package": ("packages", 1, [
        "What is the Python package {s} used for?", "Describe {s} in two sentences.",
        "I found a library called {s}: \"{o}\". What could I use it for?",
        "How do I install {s} and get started with it?", "Write a short example of using {s} in Python."]),
    "code": ("functions", 2, [
        "Write a Python function that {t}.", "What does {s} do in Python?", "Show an example of using {s}.",
        "Write a Python function that {t}, without using {s}.", "When should I use {s}?",
        "Explain this Python documentation in simple terms: \"{o}.\""]),
}


def _stream(kind: str, rng: random.Random):
    """Every (snippet, template) pair of a kind once: each snippet with one template first, in shuffled order."""
    part, _, templates = KINDS[kind]
    items = list(_corpus()[part])
    rng.shuffle(items)
    for r in range(len(templates)):
        for i, (s, o) in enumerate(items):
            template = templates[(i + r) % len(templates)]
            task = _task(o) if "{t}" in template else ""
            if task is not None:
                yield template.format(s=s, o=o, t=task, l=s[0].lower() + s[1:])


def training_prompts(n: int, seed: int = 0, exclude: Iterable[str] = ()) -> list[list[dict]]:
    """n distinct prompts, deterministic for a seed (on the same installed packages), shuffled so that kinds
    interleave; none whose text contains any string in `exclude` (pass `benchmark_exclusions()`)."""
    rng = random.Random(seed)
    streams = {k: _stream(k, random.Random(f"{seed}:{k}")) for k in KINDS}
    banned = sorted({e for e in exclude if e.strip()})
    hit = re.compile("|".join(map(re.escape, banned))).search if banned else lambda _: None
    seen: set[str] = set()
    out: list[list[dict]] = []
    while len(out) < n and streams:
        kind = rng.choices(list(streams), [KINDS[k][1] for k in streams])[0]
        text = next(streams[kind], None)
        if text is None:
            del streams[kind]
        elif text not in seen and not hit(text):
            seen.add(text)
            out.append([{"role": "user", "content": text}])
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct prompts can be built on this machine, {n} asked")
    return out


def benchmark_exclusions(repetitive_n: int = 1024) -> list[str]:
    """The first 60 characters of every benchmark prompt's messages (benchmarks/prompts.py: CHAT, CODE, GROUNDED
    and the first `repetitive_n` of `repetitive`), to pass as `exclude` so no held-out prompt leaks into training."""
    spec = importlib.util.spec_from_file_location("_benchmark_prompts", REPO / "benchmarks" / "prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def contents(x) -> list[str]:  # the message contents in nested lists of strings or chat messages
        if isinstance(x, (str, dict)):
            return [x if isinstance(x, str) else x.get("content", "")]
        return [c for y in x for c in contents(y)]
    sets = [getattr(mod, name, []) for name in ("CHAT", "CODE", "GROUNDED")] + [mod.repetitive(repetitive_n)]
    return sorted({c[:60] for c in contents(sets) if c.strip()})
