"""A reward from any HTTP server that speaks ``rlhfkit serve-rm``'s schema: step 3's ``--reward_url``.

``--reward_url URL[:WEIGHT]`` (repeatable): the weight follows the URL's path, after its last colon
(``http://host:8000/score:0.5``); a URL without a path (``http://host:8000``) takes no weight, so its
port is never read as one. Each URL is a reward component like a ``--reward_fn``: weighted, logged as
``reward/fn/<URL>``, normalised with ``--normalize_reward_fns``, its scores checked for count and
finiteness.

The client (httpx) sends a batch's conversations in requests of at most ``max_batch`` responses,
``{"messages": [[...prompt turns, {"role": "assistant", "content": response}], ...]}``, and reads
``{"scores": [...]}``. A timeout, a refused connection, a 5xx or 429, or an answer that is not
``{"scores": [one finite number per response]}`` is retried with exponential backoff; after the last
retry the run stops with an error naming the URL and the last failure. A 4xx other than 429 is not
retried: the request itself is wrong.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from rlhfkit.errors import ConfigError, RlhfkitError


def parse_url_spec(spec: str, default_weight: float) -> tuple[str, float]:
    """``"http://h:8000/score:0.5"`` -> (``"http://h:8000/score"``, 0.5); ``"http://h:8000"`` -> (it, default)."""
    head, sep, tail = spec.rpartition(":")
    if sep and urlsplit(head).path not in ("", "/") and "/" not in tail:
        try:
            weight = float(tail)
        except ValueError:
            weight = None
        if weight is not None:
            return check_url(head), weight
    return check_url(spec), default_weight


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--reward_url {url}: not an http(s) URL (e.g. http://127.0.0.1:8000/score)")
    return url


class RemoteReward:
    """``(prompts, responses, rows, messages=...) -> scores`` from the server at ``url``."""

    wants_messages = True  # RewardFunctions passes each sample's prompt turns

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0, max_batch: int = 64):
        try:
            import httpx
        except ImportError:
            raise ConfigError("--reward_url needs httpx: pip install 'rlhfkit[serve]'") from None
        self.url, self.timeout, self.retries, self.backoff, self.max_batch = url, timeout, retries, backoff, max_batch
        self.client = httpx.Client(timeout=timeout)

    def __call__(self, prompts: list, responses: list, rows: list, messages: Optional[list] = None) -> list[float]:
        if messages is None:  # no chat turns known: each prompt text is one user turn
            messages = [[{"role": "user", "content": p}] for p in prompts]
        convs = [list(m) + [{"role": "assistant", "content": r}] for m, r in zip(messages, responses)]
        out: list[float] = []
        for i in range(0, len(convs), self.max_batch):
            out += self.post(convs[i:i + self.max_batch])
        return out

    def post(self, convs: list) -> list[float]:
        """One request, retried; its scores, checked."""
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = self.client.post(self.url, json={"messages": convs})
            except httpx.HTTPError as e:  # timeouts, refused connections, broken streams
                last = f"{type(e).__name__}: {e}"
                continue
            if 400 <= r.status_code < 500 and r.status_code != 429:
                raise RlhfkitError(f"reward server {self.url} rejected the request (HTTP {r.status_code}): {r.text[:300]}")
            if r.status_code != 200:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            scores, last = read_scores(r, len(convs))
            if scores is not None:
                return scores
        raise RlhfkitError(f"reward server {self.url}: no usable answer after {self.retries + 1} attempts "
                           f"(timeout {self.timeout:g} s); last: {last}")


def read_scores(response: Any, n: int) -> tuple[Optional[list[float]], str]:
    """(scores, "") when the body is {"scores": [n finite numbers]}, else (None, what is wrong)."""
    try:
        scores = response.json()["scores"]
        scores = [float(s) for s in scores]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"not {{\"scores\": [numbers]}} ({type(e).__name__}): {response.text[:200]!r}"
    if len(scores) != n:
        return None, f"{len(scores)} scores for {n} responses"
    if not all(math.isfinite(s) for s in scores):
        return None, f"a score is not finite: {scores[:8]}"
    return scores, ""
