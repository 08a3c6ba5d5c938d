"""`rlhfkit serve-rm`: a step-2 reward model behind HTTP, for step 3's ``--reward_url`` or any client.

Needs the ``serve`` extra (``pip install rlhfkit[serve]``: FastAPI and uvicorn, as OpenRLHF's serve_rm).

    POST /score   {"prompts": [str, ...], "responses": [str, ...]}                  -> {"scores": [float, ...]}
              or  {"messages": [[{"role": ..., "content": ...}, ...], ...]}           (same answer)
    GET  /health  -> {"status": "ok", "model": DIR, "max_batch": N}

- ``prompts[i]`` is one user turn; with ``messages`` each conversation ends with the assistant turn to score.
- Scoring is ``rlhfkit score``'s rule (:func:`rlhfkit.scoring.score_responses`): the reward model's own
  tokenizer and chat template, the response + EOS, the score read at the last real token.
- Requests that arrive while the model is busy are scored together, up to ``--max_batch`` responses per
  forward pass; one request's responses stay in order, in batches of ``--max_batch``, so a lone request
  gets exactly the scores of ``rlhfkit score --batch_size N`` on the same rows.
- A malformed request gets a 4xx with ``{"error": "..."}``; a failure while scoring gets a 500 with
  ``{"error": "..."}``. Neither stops the server.
"""
# no `from __future__ import annotations` here: FastAPI reads the route functions' annotations as objects

import argparse
import asyncio
from contextlib import asynccontextmanager
from typing import Any, Callable, Literal, Optional

from rlhfkit.errors import ConfigError

ScoreFn = Callable[[list[dict]], list[float]]  # rows {"messages", "response"} -> scores

DESCRIPTION = ("Serve a step-2 reward model over HTTP: POST /score {prompts, responses} or {messages} -> {scores}; "
               "GET /health. Concurrent requests are batched together. Needs `pip install rlhfkit[serve]`.")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="reward model directory (step 2 output)")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    p.add_argument("--max_batch", type=int, default=16, help="most responses in one forward pass")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default: the training run's")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--allow_pickle_weights", action="store_true")
    return p


def request_rows(body: Any) -> list[dict]:
    """The rows {"messages": prompt turns, "response": str} of a /score body; ValueError says what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object: {\"prompts\": [...], \"responses\": [...]} or {\"messages\": [...]}")
    if "messages" in body:
        convs = body["messages"]
        if not isinstance(convs, list) or not convs:
            raise ValueError("\"messages\" must be a non-empty list of conversations")
        return [conversation_row(i, c) for i, c in enumerate(convs)]
    prompts, responses = body.get("prompts"), body.get("responses")
    if not isinstance(prompts, list) or not isinstance(responses, list) or not prompts:
        raise ValueError("give \"prompts\" and \"responses\", two non-empty lists of strings (or \"messages\")")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses: give one response per prompt")
    if not all(isinstance(x, str) for x in prompts + responses):
        raise ValueError("every prompt and response must be a string")
    return [{"messages": [{"role": "user", "content": p}], "response": r} for p, r in zip(prompts, responses)]


def conversation_row(i: int, conv: Any) -> dict:
    roles: tuple[Literal["system", "user", "assistant"], ...] = ("system", "user", "assistant")
    if not isinstance(conv, list) or len(conv) < 2:
        raise ValueError(f"messages[{i}] must be a list of turns ending with the assistant's response")
    for turn in conv:
        if not (isinstance(turn, dict) and turn.get("role") in roles and isinstance(turn.get("content"), str)):
            raise ValueError(f"messages[{i}]: each turn is {{\"role\": system|user|assistant, \"content\": str}}, got {turn!r:.120}")
    if conv[-1]["role"] != "assistant" or not any(t["role"] == "user" for t in conv[:-1]):
        raise ValueError(f"messages[{i}] must end with an assistant turn that follows a user turn")
    return {"messages": [dict(t) for t in conv[:-1]], "response": conv[-1]["content"]}


class Batcher:
    """Scores queued requests together: one worker takes every request waiting (up to ``max_batch`` responses,
    at least one request), scores them in one thread call, and answers each with its own scores."""

    def __init__(self, score: ScoreFn, max_batch: int):
        self.score, self.max_batch = score, max_batch
        self.queue: Optional[asyncio.Queue] = None

    async def submit(self, rows: list[dict]) -> list[float]:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, fut))
        return await fut

    def score_in_batches(self, jobs: list[list[dict]]) -> list[float]:
        """Each job's rows in batches of ``max_batch``; small jobs share a batch, in arrival order."""
        rows = [r for job in jobs for r in job]
        if len(jobs) == 1:
            return [s for i in range(0, len(rows), self.max_batch) for s in self.score(rows[i:i + self.max_batch])]
        return self.score(rows)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        carried = None  # a request that did not fit the last batch: it starts the next one
        while True:
            jobs = [carried if carried is not None else await self.queue.get()]
            carried, size = None, len(jobs[0][0])
            while not self.queue.empty():
                job = self.queue.get_nowait()
                if size + len(job[0]) > self.max_batch:
                    carried = job
                    break
                jobs.append(job)
                size += len(job[0])
            try:
                scores = await loop.run_in_executor(None, self.score_in_batches, [rows for rows, _ in jobs])
            except Exception as e:  # noqa: BLE001 - answer every waiting request, keep serving
                for _, fut in jobs:
                    fut.set_exception(e)
                continue
            start = 0
            for rows, fut in jobs:
                fut.set_result(scores[start:start + len(rows)])
                start += len(rows)


def build_app(score: ScoreFn, max_batch: int, model_name: str = "") -> Any:
    """The FastAPI app: /score and /health over ``score`` (rows -> scores)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
    except ImportError:
        raise ConfigError("rlhfkit serve-rm needs FastAPI and uvicorn: pip install 'rlhfkit[serve]'") from None

    @asynccontextmanager
    async def lifespan(app: Any):
        app.state.batcher.queue = asyncio.Queue()
        worker = asyncio.create_task(app.state.batcher.run())
        yield
        worker.cancel()

    app = FastAPI(title="rlhfkit reward model", lifespan=lifespan)
    app.state.batcher, app.state.model_name = Batcher(score, max_batch), model_name

    @app.exception_handler(RequestValidationError)
    async def bad_json(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": f"the body is not valid JSON: {exc.errors()[:1]}"}, status_code=400)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": app.state.model_name, "max_batch": max_batch}

    @app.post("/score")
    async def score_route(request: Request) -> JSONResponse:
        try:
            rows = request_rows(await request.json())
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            return JSONResponse({"error": str(e)}, status_code=400)
        try:
            scores = await app.state.batcher.submit(rows)
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"error": f"scoring failed: {type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse({"scores": scores})

    return app


def model_scorer(model_dir: str, dtype: Optional[str], trust_remote_code: bool = False,
                 allow_pickle: bool = False) -> ScoreFn:
    """rows -> scores with the reward model in ``model_dir``, by :func:`rlhfkit.scoring.score_responses`."""
    import functools

    from rlhfkit.scoring import load_reward_model

    model, tokenizer, _ = load_reward_model(model_dir, dtype, trust_remote_code, allow_pickle)
    return functools.partial(score_rows, model, tokenizer)


def score_rows(model: Any, tokenizer: Any, rows: list[dict]) -> list[float]:
    from rlhfkit.scoring import score_responses

    return score_responses(model, tokenizer, rows, batch_size=max(len(rows), 1))


def serve(args: argparse.Namespace) -> None:
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("rlhfkit serve-rm needs FastAPI and uvicorn: pip install 'rlhfkit[serve]'") from None
    if args.max_batch < 1:
        raise ConfigError(f"--max_batch must be >= 1, got {args.max_batch}")
    app = build_app(model_scorer(args.model, args.dtype, args.trust_remote_code, args.allow_pickle_weights),
                    args.max_batch, args.model)
    print(f"serving {args.model} on http://{args.host}:{args.port}/score (health: /health)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
