"""
Where the search task's queries go: an in-process BM25 index, or the HTTP retrieval server that
search-RL users already run (Search-R1's `search_r1/search/retrieval_server.py`, which Dr. MAS calls
too), by URL.

    index = BM25(passages)                         # passages in Search-R1's corpus format
    hits = index.search("who wrote hamlet", 3)     # [Passage], best first
    server = HttpRetriever("http://127.0.0.1:8000/retrieve")
    hits = server.search("who wrote hamlet", 3)    # POST {"queries", "topk", "return_scores"}

A passage is Search-R1's corpus row: {"id", "contents"}, contents = '"Title"\\ntext'. A search that
fails (server down, any transport or protocol error, a reply that is not the API's, over the size
cap or past the deadline) raises RetrievalError: the env counts it and shows the agent that its
search failed; it is never an empty result, and never another exception.
"""
import hashlib
import http.client
import json
import math
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass


class RetrievalError(Exception):
    pass


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str  # '"Title"\ntext'

    @property
    def title(self):
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self):
        return self.contents.split("\n", 1)[1] if "\n" in self.contents else self.contents


# searches run and failed, over the process (the step log's search_calls, search_failures)
stats = {"calls": 0, "failures": 0}
_stats_lock = threading.Lock()


def count(failed, error=""):
    """One search run; a failed one is logged (the first three, then every 100th: not a flood)."""
    with _stats_lock:
        stats["calls"] += 1
        stats["failures"] += int(failed)
        failures = stats["failures"]
    if failed and (failures <= 3 or failures % 100 == 0):
        print(f"search failure {failures} (of {stats['calls']} searches): {error}", file=sys.stderr,
              flush=True)


def tokenize(text):
    return re.findall(r"\w+", text.lower())


class BM25:
    """Okapi BM25 with Lucene's idf, log(1 + (N - df + 0.5) / (df + 0.5)), and k1 = 1.5, b = 0.75:
    the scores of bm25s's method "lucene" (the test checks them against it). Ties go to the earlier
    passage. Written by hand, not bm25s: importing bm25s loads llvmlite, which breaks vLLM's scan of
    sys.modules at start-up (docs/design.md, "BM25 stays written by hand")."""

    def __init__(self, passages, k1=1.5, b=0.75):
        self.passages = list(passages)
        if not self.passages:
            raise ValueError("BM25 over an empty corpus: give it passages")
        self.k1, self.b = k1, b
        self.docs = [Counter(tokenize(p.contents)) for p in self.passages]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg_length = sum(self.lengths) / len(self.lengths)
        df = Counter(t for d in self.docs for t in d)
        n = len(self.docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query):
        out = []
        for doc, length in zip(self.docs, self.lengths):
            norm = self.k1 * ((1 - self.b) + self.b * length / self.avg_length)
            out.append(sum(self.idf[t] * doc[t] / (norm + doc[t]) for t in tokenize(query) if t in doc))
        return out

    def search(self, query, topk):
        scores = self.scores(query)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.passages[i] for i in order[:topk]]


class HttpRetriever:
    """Search-R1's retrieval server: POST {"queries": [q], "topk": k, "return_scores": true} to the
    URL; the reply is {"result": [[{"document": {"id", "contents", ...}, "score": s}, ...]]}
    (`search_r1/search/retrieval_server.py`, the /retrieve endpoint), or, from a server that leaves
    the scores out, {"result": [[document, ...]]}.

    It cannot take the run down: any failure (connection, an http.client error, a reply that is not
    HTTP 200, not JSON, of another shape, a document whose contents is not a string, a reply over
    `max_reply_bytes`, no whole reply within `timeout` seconds) raises RetrievalError, which the env
    counts and shows the agent. `timeout` bounds the whole exchange (connect, send, every read), not
    each socket read: a server that drips its reply is cut at the deadline."""

    def __init__(self, url, timeout=30.0, max_reply_bytes=16 << 20):
        self.url, self.timeout, self.max_reply_bytes = url, timeout, max_reply_bytes

    def search(self, query, topk):
        body = json.dumps({"queries": [query], "topk": topk, "return_scores": True}).encode()
        try:
            return passages_from_reply(json.loads(self.post(body)), topk)
        except RetrievalError as e:
            raise RetrievalError(f"{self.url}: {e}") from None
        # every other way a reply can go wrong: http.client's errors derive from HTTPException, not
        # OSError; a bad URL, a body not UTF-8 or not JSON are ValueErrors; deep nesting recurses
        except (http.client.HTTPException, OSError, ValueError, RecursionError) as e:
            raise RetrievalError(f"{self.url}: {type(e).__name__}: {str(e)[:200]}") from None

    def post(self, body):
        """The reply's body to one POST, read within one deadline: a timer shuts the socket down at
        `timeout` (a socket timeout bounds each read alone: a dripping server never trips it)."""
        start = time.monotonic()
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RetrievalError("not an http(s)://HOST:PORT/retrieve URL")
        https = parts.scheme == "https"
        conn = (http.client.HTTPSConnection if https else http.client.HTTPConnection)(
            parts.hostname, parts.port, timeout=self.timeout)
        timer = None
        try:
            conn.connect()  # bounded by the socket timeout
            left = max(0.0, self.timeout - (time.monotonic() - start))
            timer = threading.Timer(left, _cut, (conn.sock,))
            timer.daemon = True
            timer.start()
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            if reply.status != 200:
                raise RetrievalError(f"HTTP {reply.status} {reply.reason[:100]}")
            expected = reply.length  # Content-Length (None: chunked, or read to the close)
            if expected is not None and expected > self.max_reply_bytes:
                raise RetrievalError(f"a reply of {expected} bytes, over {self.max_reply_bytes} "
                                     "(max_reply_bytes)")
            data, size = [], 0
            while size <= self.max_reply_bytes:  # a cap on memory: a reply past it is refused
                chunk = reply.read(1 << 16)
                if not chunk:
                    break
                data.append(chunk)
                size += len(chunk)
            if size > self.max_reply_bytes:
                raise RetrievalError(f"a reply over {self.max_reply_bytes} bytes (max_reply_bytes)")
            # read(amt) returns a body cut short without raising IncompleteRead (read() raises it)
            if expected is not None and size != expected:
                raise RetrievalError(f"a reply cut short: {size} of its {expected} bytes")
        except (http.client.HTTPException, OSError, RetrievalError):
            if time.monotonic() - start >= self.timeout:  # the timer cut it: say so, not what broke
                raise RetrievalError(f"no whole reply within {self.timeout} s") from None
            raise
        finally:
            if timer:
                timer.cancel()
            conn.close()
        if time.monotonic() - start >= self.timeout:  # a reply read to its close, cut by the timer
            raise RetrievalError(f"no whole reply within {self.timeout} s")
        return b"".join(data)

    def check(self):
        """One probe query before training: anything that is not a working retrieval server (down,
        another service on the port, a reply of another shape) stops the run with one line."""
        try:
            self.search("test", 1)
        except RetrievalError as e:
            raise SystemExit(f"--retriever {self.url} is not a working retrieval server ({e}): "
                             "start Search-R1's search_r1/search/retrieval_server.py "
                             "(POST /retrieve) there, or use --retriever bm25:CORPUS.jsonl")


def _cut(sock):
    """The deadline's timer: wake a read blocked on `sock` (it then sees the connection closed)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):  # closed already, or never connected
        pass


def passages_from_reply(reply, topk):
    """The passages in a /retrieve reply (its first query's hits, at most topk), checked: every hit
    a document (or {"document": document, "score"}) whose contents is a string."""
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, list) or not result or not isinstance(result[0], list):
        raise RetrievalError('the reply is not Search-R1\'s {"result": [[hit, ...]]}: '
                             f"{json.dumps(reply)[:100]}")
    passages = []
    for hit in result[0][:topk]:
        document = hit.get("document", hit) if isinstance(hit, dict) else None
        if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
            raise RetrievalError(f"a hit without a string 'contents': {json.dumps(hit)[:100]}")
        passages.append(Passage(passage_id(document), document["contents"]))
    return passages


def passage_id(document):
    """The document's own id; where it has none (Search-R1's BM25 server sends {title, text,
    contents} when its index stores the documents), one from its contents: the same passage gets
    the same id on every search, so the env's de-duplication (and its search reward) still works."""
    given = document.get("id")
    if isinstance(given, (str, int)) and not isinstance(given, bool) and str(given):
        return str(given)
    digest = hashlib.sha1(document["contents"].encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha1:{digest[:16]}"


def load_corpus(path):
    """Passages from a Search-R1 corpus file: one {"id", "contents"} per line (no id: the line's
    number)."""
    passages = []
    for where, n, row in read_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
            raise ValueError(f'{where}: a corpus row is {{"id", "contents": "..."}} (Search-R1\'s)')
        passages.append(Passage(str(row.get("id", n)), row["contents"]))
    if not passages:
        raise ValueError(f"{path}: no passages in it")
    return passages


def read_rows(path):
    """(where, row index, row) of each JSON row of a file: a jsonl (where = "path:LINE", 1-based),
    or one JSON list (HotpotQA's distributed hotpot_train_v1.1.json; where = "path: row N").
    Every error is a ValueError that names the file and the row."""
    with open(path, encoding="utf-8") as f:
        try:
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith("["):
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not JSON ({e}): a jsonl (a JSON object a line) or "
                                     "one JSON list of objects (HotpotQA's)") from None
                return [(f"{path}: row {n + 1}", n, row) for n, row in enumerate(rows)]
            out = []
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append((f"{path}:{line_number}", len(out), json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_number}: not JSON ({e}): a jsonl holds one "
                                     "JSON object a line") from None
            return out
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def load_questions(path):
    """Questions with their gold answers, from a file in either format search-RL uses, one JSON
    object a line (jsonl) or HotpotQA's own one JSON list:
    Search-R1 / FlashRAG (NQ, HotpotQA...): {"question", "golden_answers": [...]} (or
    reward_model.ground_truth.target); HotpotQA's own: {"question", "answer", "context": [[title,
    [sentences]], ...]}, whose context paragraphs become that question's passages.
    Every row is checked here, so that a bad file stops the run before anything loads, with a
    ValueError that names the file and the row (the 1-based line of a jsonl).
    Returns [{"question", "answers", "passages" (None: use the shared retriever), "gold"}]."""
    rows = [question_row(row, where, n) for where, n, row in read_rows(path)]
    if not rows:
        raise ValueError(f"{path}: no questions in it: give a jsonl of questions, one per line (or "
                         "HotpotQA's one JSON list)")
    return rows


def question_row(row, where, n):
    """One checked question row (see load_questions): `where` names it in errors; `n` numbers its
    passages."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a question is a JSON object, not {type(row).__name__}")
    answers = row.get("golden_answers")
    if answers is None and isinstance(row.get("reward_model"), dict):
        answers = ((row["reward_model"].get("ground_truth") or {}).get("target")
                   if isinstance(row["reward_model"].get("ground_truth"), dict) else None)
    if answers is None:
        answers = row.get("answer")
    if not isinstance(row.get("question"), str) or not row["question"].strip() or answers is None:
        raise ValueError(f"{where}: a question needs 'question' (a string) and 'golden_answers' "
                         "(Search-R1 / FlashRAG) or 'answer' (HotpotQA)")
    answers = [answers] if isinstance(answers, (str, int, float)) else answers
    if (not isinstance(answers, list) or not answers
            or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                       for a in answers)):
        raise ValueError(f"{where}: the gold answers are a string or a list of strings, "
                         f"not {answers!r:.80}")
    passages, gold = None, ()
    if row.get("context"):
        context = row["context"]
        if not isinstance(context, list) or not all(
                isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)
                and isinstance(c[1], list) and all(isinstance(x, str) for x in c[1])
                for c in context):
            raise ValueError(f"{where}: 'context' is HotpotQA's [[title, [sentence, ...]], ...]")
        passages = [Passage(f"{n}-{i}", f'"{title}"\n' + " ".join(sentences))
                    for i, (title, sentences) in enumerate(context)]
        facts = row.get("supporting_facts") or []
        if not isinstance(facts, list) or not all(
                isinstance(x, list) and x and isinstance(x[0], str) for x in facts):
            raise ValueError(f"{where}: 'supporting_facts' is HotpotQA's [[title, sentence], ...]")
        titles = {x[0] for x in facts}
        gold = tuple(p.id for p in passages if p.title in titles)
    return {"question": row["question"], "answers": [str(a) for a in answers], "passages": passages,
            "gold": gold}


def settings(cfg):
    """--task search: passages per search, the retriever (None: each question's own passages: the
    generated worlds, HotpotQA's context), the answer's metric. A retrieval server is asked once
    here."""
    if cfg["task"] != "search":
        return None
    retriever = None
    if cfg["retriever"].startswith("bm25:"):
        try:
            retriever = BM25(load_corpus(cfg["retriever"][5:]))
        except ValueError as e:  # names the file and the line
            raise SystemExit(f"--retriever {cfg['retriever']}: {e}")
    elif cfg["retriever"]:
        retriever = HttpRetriever(cfg["retriever"])
        retriever.check()
    return dict(topk=cfg["search_topk"], retriever=retriever, metric=cfg["search_metric"])
