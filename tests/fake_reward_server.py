"""A stand-in reward server for the client's fault tests (run as a script; the real server is
`rlhfkit serve-rm`). It scores a response by its length in characters, as `rlhfkit serve-rm` answers:
{"scores": [...]} for {"messages": [[..., {"role": "assistant", "content": response}], ...]}.

    python tests/fake_reward_server.py --port P [--die_after K] [--garbage] [--short] [--nan]

--die_after K  answer K requests, then exit the process when the next one arrives (a crash mid-run)
--garbage      answer 200 with a body that is not JSON
--short        answer one score too few
--nan          answer NaN for the first response
"""

import argparse
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

app = FastAPI()
ARGS = argparse.Namespace()
SERVED = {"n": 0}


@app.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@app.post("/score")
async def score(request: Request):
    if ARGS.die_after is not None and SERVED["n"] >= ARGS.die_after:
        os._exit(1)
    SERVED["n"] += 1
    convs = (await request.json())["messages"]
    scores = [float(len(c[-1]["content"])) for c in convs]
    if ARGS.garbage:
        return PlainTextResponse("<html>502 upstream</html>")
    if ARGS.short:
        scores = scores[:-1]
    if ARGS.nan:
        return PlainTextResponse('{"scores": [NaN' + "".join(f", {s}" for s in scores[1:]) + "]}")
    return JSONResponse({"scores": scores})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--die_after", type=int, default=None)
    p.add_argument("--garbage", action="store_true")
    p.add_argument("--short", action="store_true")
    p.add_argument("--nan", action="store_true")
    p.parse_args(namespace=ARGS)
    uvicorn.run(app, host="127.0.0.1", port=ARGS.port, log_level="warning")
