"""
Where the search task's queries go: an in-process BM25 index, or the HTTP retrieval server that
search-RL users already run (Search-R1's `search_r1/search/retrieval_server.py`, which Dr. MAS calls
too), by URL.

    index = BM25(passages)                         # passages in Search-R1's corpus format
    hits = index.search("who wrote hamlet", 3)     # [Passage], best first
    server = HttpRetriever("http://127.0.0.1:8000/retrieve")
    hits = server.search("who wrote hamlet", 3)    # POST {"queries", "topk", "return_scores"}

A passage is Search-R1's corpus row: {"id", "contents"}, contents = '"Title"\\ntext'. A search that
fails (server down, a reply that is not the API's) raises RetrievalError: the env counts it and shows
the agent that its search failed; it is never an empty result.
"""
import json
import math
import re
import threading
import urllib.error
import urllib.request
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


def count(failed):
    with _stats_lock:
        stats["calls"] += 1
        stats["failures"] += int(failed)


def tokenize(text):
    return re.findall(r"\w+", text.lower())


class BM25:
    """Okapi BM25 with Lucene's idf, log(1 + (N - df + 0.5) / (df + 0.5)), and k1 = 1.5, b = 0.75:
    the scores of bm25s's method "lucene" (the test checks them against it). Ties go to the earlier
    passage."""

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
    (`search_r1/search/retrieval_server.py`, the /retrieve endpoint)."""

    def __init__(self, url, timeout=30.0):
        self.url, self.timeout = url, timeout

    def search(self, query, topk):
        body = json.dumps({"queries": [query], "topk": topk, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                result = json.loads(reply.read())["result"][0]
            return [Passage(str(hit["document"].get("id", "")), hit["document"]["contents"]) for hit in result]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise RetrievalError(f"{self.url}: {type(e).__name__}: {e}") from e

    def check(self):
        """One probe query before training: a server that is down stops the run with one line."""
        try:
            self.search("test", 1)
        except RetrievalError as e:
            raise SystemExit(f"--retriever {self.url} does not answer ({e}): start the retrieval server "
                             "(Search-R1's search_r1/search/retrieval_server.py, POST /retrieve), or use "
                             "--retriever bm25:CORPUS.jsonl")


def load_corpus(path):
    """Passages from a Search-R1 corpus file: one {"id", "contents"} per line."""
    passages = []
    with open(path) as f:
        for n, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                passages.append(Passage(str(row.get("id", n)), row["contents"]))
    return passages


def load_questions(path):
    """Questions with their gold answers, from a jsonl in either format search-RL uses:
    Search-R1 / FlashRAG (NQ, HotpotQA...): {"question", "golden_answers": [...]} (or
    reward_model.ground_truth.target); HotpotQA's own: {"question", "answer", "context": [[title,
    [sentences]], ...]}, whose context paragraphs become that question's passages.
    Returns [{"question", "answers", "passages" (None: use the shared retriever), "gold"}]."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            answers = row.get("golden_answers")
            if answers is None and "reward_model" in row:
                answers = row["reward_model"]["ground_truth"]["target"]
            if answers is None and "answer" in row:
                answers = [row["answer"]]
            if not row.get("question") or answers is None:
                raise ValueError(f"{path}:{n + 1}: a question needs 'question' and 'golden_answers' "
                                 "(Search-R1 / FlashRAG) or 'answer' (HotpotQA)")
            answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
            passages, gold = None, ()
            if row.get("context"):
                passages = [Passage(f"{n}-{i}", f'"{title}"\n' + " ".join(sentences))
                            for i, (title, sentences) in enumerate(row["context"])]
                titles = {title for title, _ in row.get("supporting_facts", [])}
                gold = tuple(p.id for p in passages if p.title in titles)
            rows.append({"question": row["question"], "answers": answers, "passages": passages, "gold": gold})
    return rows
