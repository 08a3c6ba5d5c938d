"""`rlhfkit serve-rm` and step 3's `--reward_url`: the server's scores against `rlhfkit score`, its
batching and its answers to bad requests; the client's retries and errors; a GRPO run on 2 ranks that
scores through a server, and one whose server dies mid-run."""

import asyncio
import json
import math
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from rlhfkit.errors import ConfigError, RlhfkitError
from rlhfkit.rewards.remote import RemoteReward, parse_url_spec
from rlhfkit.serve_rm import Batcher, build_app, request_rows
from testutils import REPO, VENV_BIN, env_for_ranks, free_port, run_program

ROWS = [{"prompt": f"Question {i}: what is {'very ' * (i % 4)}big?", "response": "Big " * (1 + i % 5) + f"answer {i}."}
        for i in range(10)]


def start(cmd: list[str], port: int, timeout: float = 120.0) -> subprocess.Popen:
    """Start a server process and wait until /health answers."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for_ranks(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start")


@pytest.fixture(scope="module")
def server(reward_dir):
    """`rlhfkit serve-rm` on the tiny reward model, fp32, 4 responses per forward pass."""
    port = free_port()
    proc = start([str(VENV_BIN / "rlhfkit"), "serve-rm", "--model", str(reward_dir), "--port", str(port), "--max_batch", "4",
                  "--dtype", "fp32"], port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def fake_server(port: int, *flags: str) -> subprocess.Popen:
    return start([sys.executable, str(REPO / "tests" / "fake_reward_server.py"), "--port", str(port), *flags], port)


def test_request_rows_by_hand():
    assert request_rows({"prompts": ["p"], "responses": ["r"]}) == [
        {"messages": [{"role": "user", "content": "p"}], "response": "r"}]
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert request_rows({"messages": [conv]}) == [{"messages": conv[:2], "response": "r"}]
    for body, message in [([], "must be a JSON object"), ({"prompts": ["a", "b"], "responses": ["c"]}, "2 prompts but 1 responses"),
                          ({"prompts": ["a"], "responses": [3]}, "must be a string"), ({"prompts": []}, "two non-empty lists"),
                          ({"messages": [conv[:2]]}, "must end with an assistant turn"),
                          ({"messages": [[{"role": "bot", "content": "x"}, conv[2]]]}, "each turn is"),
                          ({"messages": []}, "non-empty list of conversations")]:
        with pytest.raises(ValueError, match=message):
            request_rows(body)


def test_url_weights_follow_the_path():
    assert parse_url_spec("http://h:8000/score:0.5", 1.0) == ("http://h:8000/score", 0.5)
    assert parse_url_spec("http://h:8000/score", 0.3) == ("http://h:8000/score", 0.3)
    assert parse_url_spec("http://h:8000", 1.0) == ("http://h:8000", 1.0)  # the port is not a weight
    assert parse_url_spec("https://h/score:-2", 1.0) == ("https://h/score", -2.0)
    with pytest.raises(ConfigError, match="not an http"):
        parse_url_spec("h:8000/score", 1.0)


def test_batcher_merges_waiting_requests_up_to_max_batch():
    """Five requests of 2 responses queued before the worker runs: passes of 2+2, 2+2, 2 with max_batch 4. A lone
    request of 10 is scored in passes of 4, 4, 2, in order. Each request gets its own scores back."""
    passes = []

    def score(rows):
        passes.append(len(rows))
        return [float(r["id"]) for r in rows]

    async def go():
        batcher = Batcher(score, max_batch=4)
        batcher.queue = asyncio.Queue()
        jobs = [asyncio.ensure_future(batcher.submit([{"id": 10 * j + k} for k in range(2)])) for j in range(5)]
        await asyncio.sleep(0)  # every job is queued
        worker = asyncio.ensure_future(batcher.run())
        answers = await asyncio.gather(*jobs)
        alone = await batcher.submit([{"id": i} for i in range(10)])
        worker.cancel()
        return answers, alone

    answers, alone = asyncio.run(go())
    assert answers == [[10.0 * j, 10.0 * j + 1] for j in range(5)]
    assert alone == [float(i) for i in range(10)]
    assert passes == [4, 4, 2, 4, 4, 2]


def test_bad_requests_get_4xx_json_and_a_failing_score_a_500():
    calls = {"n": 0}

    def score(rows):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("out of memory")
        return [1.0] * len(rows)

    with TestClient(build_app(score, 4, "m")) as client:
        assert client.get("/health").json() == {"status": "ok", "model": "m", "max_batch": 4}
        r = client.post("/score", content=b"{not json")
        assert r.status_code == 400 and "error" in r.json()
        r = client.post("/score", json={"prompts": ["a"], "responses": ["b", "c"]})
        assert r.status_code == 400 and r.json() == {"error": "1 prompts but 2 responses: give one response per prompt"}
        r = client.post("/score", json={"prompts": ["a"], "responses": ["b"]})
        assert r.status_code == 500 and r.json() == {"error": "scoring failed: RuntimeError: out of memory"}
        r = client.post("/score", json={"prompts": ["a"], "responses": ["b"]})  # still serving
        assert r.status_code == 200 and r.json() == {"scores": [1.0]}


def test_server_scores_equal_rlhfkit_score(server, reward_dir, tmp_path):
    """One request: the same scores to the bit as `rlhfkit score --batch_size 4` (same batches of 4, fp32);
    chat messages give the same; concurrent requests, batched together, within 1e-6 relative."""
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    subprocess.run([str(VENV_BIN / "rlhfkit"), "score", "--model", str(reward_dir), "--responses", str(rows_path),
                    "--batch_size", "4", "--dtype", "fp32", "--out", str(tmp_path / "scores.jsonl")], check=True,
                   env=env_for_ranks(1), capture_output=True)
    expected = [json.loads(x)["score"] for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    r = httpx.post(f"{server}/score", json={"prompts": [r["prompt"] for r in ROWS], "responses": [r["response"] for r in ROWS]})
    assert r.status_code == 200 and r.json()["scores"] == expected
    convs = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}] for r in ROWS]
    assert httpx.post(f"{server}/score", json={"messages": convs}).json()["scores"] == expected
    answers = [None] * len(ROWS)

    def ask(i):
        answers[i] = httpx.post(f"{server}/score", json={"messages": [convs[i]]}, timeout=60).json()["scores"][0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(ROWS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == pytest.approx(expected, rel=1e-6)
    r = httpx.post(f"{server}/score", json={"prompts": ["a"]})  # a bad request: 400, and the server goes on
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_client_retries_then_names_the_url():
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RlhfkitError, match=rf"reward server {url}: no usable answer after 3 attempts .*ConnectError"):
        RemoteReward(url, timeout=2, retries=2, backoff=0.01)(["p"], ["r"], [{}])
    for flag, what in [("--garbage", "not {\"scores\": \\[numbers\\]}"), ("--short", "1 scores for 2 responses"),
                       ("--nan", "a score is not finite")]:
        proc = fake_server(port, flag)
        try:
            with pytest.raises(RlhfkitError, match=rf"reward server {url}: no usable answer after 2 attempts.*{what}"):
                RemoteReward(url, timeout=5, retries=1, backoff=0.01)(["p", "q"], ["r", "ss"], [{}, {}])
        finally:
            proc.kill()
            proc.wait()
    proc = fake_server(port)
    try:
        client = RemoteReward(url, timeout=5, retries=0, max_batch=2)  # 5 responses: requests of 2, 2 and 1
        assert client(["p"] * 5, ["a", "bb", "ccc", "dddd", "e"], [{}] * 5) == [1.0, 2.0, 3.0, 4.0, 1.0]
        with pytest.raises(RlhfkitError, match=r"rejected the request \(HTTP 4"):
            RemoteReward(f"http://127.0.0.1:{port}/nowhere", retries=3)(["p"], ["r"], [{}])
    finally:
        proc.kill()
        proc.wait()


GRPO = ["--algo", "grpo", "--data_split", "0,0,1", "--max_prompt_seq_len", "48", "--max_answer_seq_len", "6",
        "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", "2", "--n_samples_per_prompt", "2",
        "--dtype", "fp32", "--actor_zero_stage", "3", "--progress_bar", "false", "--reward_url_retries", "1"]


@pytest.mark.distributed
def test_grpo_scores_through_a_server_on_two_ranks(tiny_dir, server, tmp_path):
    """The reward is the gsm8k rule plus the server at weight 0.5: both logged per component, and the
    server's component equals the tiny reward model's scores (negative, varied), so the actor trains."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    run_program("step3_ppo/main.py", [*GRPO, "--actor_model_name_or_path", str(tiny_dir), "--data_path", str(data),
                                      "--output_dir", str(out), "--eval_fraction", "0.25", "--max_eval_samples", "2",
                                      "--max_steps", "2", "--reward_fn", "gsm8k:1.0", "--reward_url", f"{server}/score:0.5"],
                nprocs=2)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    key = f"reward/fn/{server}/score"
    steps = [r for r in rows if key in r]
    assert len(steps) == 2 and all(math.isfinite(r[key]) and r[key] != 0 for r in steps)
    assert all(r[key + "/weighted"] == pytest.approx(0.5 * r[key]) for r in steps)
    assert f"eval/fn/{server}/score" in rows[0]
    assert (out / "actor" / "model.safetensors").exists()


@pytest.mark.distributed
def test_a_server_that_dies_mid_run_stops_it_with_the_last_state_intact(tiny_dir, tmp_path):
    """The server answers 2 requests (step 1, one per rank) and dies on the third (step 2): the run stops with
    an error naming the URL, the state saved after step 1 is complete, and a resume with a live server finishes."""
    from rlhfkit.resume import verify_state

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(8)))
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    out = tmp_path / "run"
    args = [*GRPO, "--actor_model_name_or_path", str(tiny_dir), "--data_path", str(data), "--output_dir", str(out),
            "--eval_fraction", "0", "--max_steps", "3", "--save_interval", "1", "--reward_url", url]
    proc = fake_server(port, "--die_after", "2")
    try:
        run = run_program("step3_ppo/main.py", args, nprocs=2, check=False)
    finally:
        proc.kill()
        proc.wait()
    assert run.returncode != 0 and f"error: reward server {url}: no usable answer after 2 attempts" in run.stderr
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in (out / "training_state").iterdir()) == ["step_1"]
    assert verify_state(out / "training_state" / "step_1") is None
    proc = fake_server(port)
    try:
        resumed = run_program("step3_ppo/main.py", [*args, "--resume", "auto"], nprocs=2)
    finally:
        proc.kill()
        proc.wait()
    assert "step_1" in resumed.stdout and (out / "actor" / "model.safetensors").exists()
