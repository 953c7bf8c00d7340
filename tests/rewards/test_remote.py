"""serve-rm and the HTTP client over real HTTP on 127.0.0.1 (servers run in threads of the test process)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.errors import ConfigError, RemoteRewardError
from rlhfkit.rewards.remote import RemoteRewardClient, shard_bounds
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.server import RewardServer, build_server

QUERIES = [f"prompt {i} response {i}" for i in range(5)]
PROMPTS = [f"prompt {i}" for i in range(5)]


def index_reward(tag: float):
    def reward_func(queries, prompts, labels):
        if any("boom" in q for q in queries):
            raise ValueError("cannot grade")
        return {"rewards": [float(q.split()[-1]) for q in queries], "extra_logs": {"server": [tag] * len(queries)}}
    return RewardFuncSource(reward_func, f"test:{tag}")


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/get_reward"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def raw_post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(urls, **kwargs) -> RemoteRewardClient:
    return RemoteRewardClient(urls, **{"timeout": 2.0, "retries": 2, "backoff": 0.01, **kwargs})


def test_reward_func_over_http_matches_in_process():
    with serving(RewardServer(index_reward(7.0), "127.0.0.1", 0)) as url:
        out = client([url])(QUERIES, PROMPTS, [None] * 5)
    assert out.rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and out.scores.tolist() == out.rewards.tolist()
    assert out.extra_logs["server"].tolist() == [7.0] * 5 and out.failed == 0


def test_serve_rm_cli_with_a_reward_model(tiny_reward_model_dir):
    server = build_server(["--reward_pretrain", tiny_reward_model_dir, "--port", "0", "--batch_size", "2"])
    assert server.server_address[0] == "127.0.0.1"
    with serving(server) as url:
        out = client(url.rsplit("/get_reward", 1)[0])(QUERIES)  # a bare host:port gets /get_reward appended
        with urllib.request.urlopen(url.replace("/get_reward", "/health"), timeout=5) as response:
            assert json.loads(response.read())["status"] == "ok"
    torch.testing.assert_close(out.rewards, last_token_scores(tiny_reward_model_dir, QUERIES), atol=1e-6, rtol=1e-5)


@torch.no_grad()
def last_token_scores(model_dir: str, queries: list[str]) -> torch.Tensor:
    """The reward model's score computed here with transformers alone: each query plus one eos, unpadded, through the
    backbone, then the ``score`` head applied by hand to the last token's final hidden state (float64)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = model.score.weight.double()
    assert head.shape[0] == 1 and getattr(model.score, "bias", None) is None
    scores = []
    for q in queries:
        ids = torch.tensor([tok(q + tok.eos_token, add_special_tokens=False)["input_ids"]])
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        scores.append(float(hidden[0, -1].double() @ head[0]))
    return torch.tensor(scores)


def test_serve_rm_cli_rejects_bad_flags(tmp_path, capsys):
    from rlhfkit.cli.main import main

    for argv, message in [
        (["--port", "0"], "give --reward_pretrain (a reward model) and/or --remote_rm_url (a reward_func file)"),
        (["--remote_rm_url", "builtin:math", "--load_in_4bit", "--port", "0"],
         "--load_in_4bit is not supported by 'rlhfkit serve-rm': 4-bit loading is not supported; serve the model "
         "in bf16/fp16/fp32"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_server(argv)
        with pytest.raises(SystemExit) as info:  # the command line: the same message, exit status 2
            main(["serve-rm", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("rlhfkit serve-rm: error: ") and message in err  # the flag and the fix


def test_bearer_token_required():
    with serving(RewardServer(index_reward(1.0), "127.0.0.1", 0, token="s3cret")) as url:
        body = json.dumps({"query": QUERIES}).encode()
        status, payload = raw_post(url, body)
        assert status == 401 and "bearer token" in payload["error"]
        assert raw_post(url, body, {"Authorization": "Bearer wrong"})[0] == 401
        status, payload = raw_post(url, body, {"Authorization": "Bearer s3cret"})
        assert status == 200 and payload["rewards"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert client([url], token="s3cret")(QUERIES).rewards.tolist() == payload["rewards"]
        with pytest.raises(RemoteRewardError, match=r"after 1 of 3 attempt.*HTTP 401"):
            client([url], token="")(QUERIES)


def test_malformed_requests_get_400():
    with serving(RewardServer(index_reward(1.0), "127.0.0.1", 0)) as url:
        assert raw_post(url, b"{not json")[0] == 400
        assert raw_post(url, json.dumps({"queries": QUERIES}).encode())[0] == 400
        status, payload = raw_post(url, json.dumps({"query": QUERIES, "prompts": PROMPTS[:2]}).encode())
        assert status == 400 and "5 queries but 2 prompts" in payload["error"]
        assert raw_post(url, json.dumps({"query": [1, 2]}).encode())[0] == 400
        assert raw_post(url.replace("get_reward", "nope"), b"{}")[0] == 404


def test_reward_error_on_server_is_422_and_names_the_sample():
    with serving(RewardServer(index_reward(1.0), "127.0.0.1", 0)) as url:
        queries = QUERIES[:2] + ["boom 9"]
        with pytest.raises(RemoteRewardError, match=r"1 of 3 attempt.*HTTP 422.*sample 2.*boom 9"):
            client([url])(queries)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_down_fails_after_retries_in_bounded_time():
    url = f"http://127.0.0.1:{free_port()}/get_reward"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        client([url], retries=2, backoff=0.05)(QUERIES)
    assert time.monotonic() - start < 3.0
    message = str(info.value)
    assert url in message and "3 of 3 attempt" in message and "refused" in message.lower(), message


class SlowHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(1.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


class CannedHandler(BaseHTTPRequestHandler):
    body = b"not json at all"

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def canned(body: dict | bytes) -> ThreadingHTTPServer:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler = type("Handler", (CannedHandler,), {"body": raw})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    return server


def test_slow_server_times_out():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    server.daemon_threads = True
    with serving(server) as url:
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"2 of 2 attempt.*timed out") as info:
            client([url], timeout=0.3, retries=1)(QUERIES)
        assert time.monotonic() - start < 1.5 and url in str(info.value)


@pytest.mark.parametrize("body, reason", [
    (b"not json at all", "not JSON"),
    ({"scores": [1.0] * 5}, "no 'rewards' key"),
    ({"rewards": [1.0] * 4}, "4 rewards for 5 queries"),
    ({"rewards": [1.0] * 5, "scores": [1.0] * 6}, "6 scores for 5 queries"),
    ({"rewards": ["a"] * 5}, "only numbers"),
    (b'{"rewards": [1.0, NaN, 1, 1, 1]}', r"non-finite reward \(nan\) for sample 1"),
])
def test_malformed_answers_fail_clearly(body, reason):
    with serving(canned(body)) as url:
        with pytest.raises(RemoteRewardError, match=reason) as info:
            client([url], retries=1)(QUERIES)
    assert url in str(info.value) and "2 of 2 attempt" in str(info.value)


def test_two_servers_share_a_batch_in_order():
    with serving(RewardServer(index_reward(0.0), "127.0.0.1", 0)) as url_a, \
            serving(RewardServer(index_reward(1.0), "127.0.0.1", 0)) as url_b:
        out = client([url_a, url_b])(QUERIES, PROMPTS, None)
        tiny = client([url_a, url_b])(QUERIES[:1])
    assert out.rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out.extra_logs["server"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert tiny.rewards.tolist() == [0.0]
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)] and shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_labels_must_be_json():
    with pytest.raises(RemoteRewardError, match="JSON"):
        client(["http://127.0.0.1:9/get_reward"])(["q"], ["p"], [object()])


class Unavailable(BaseHTTPRequestHandler):
    """Answers every POST with 503 and counts them."""

    posts = 0

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        self.send_response(503)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def flag_clients(url: str, **flags) -> list:
    """The reward client each command builds from its flags: ppo's (rl/reward_group.text_sources) and
    batch-inference's (inference/batch.score -> rewards/sources.reward_source_from_config)."""
    import rlhfkit.rewards.sources as sources
    from rlhfkit.cli.batch_inference import GROUPS as BI_GROUPS
    from rlhfkit.cli.ppo import GROUPS as PPO_GROUPS
    from rlhfkit.config.parse import flags_to_argv, parse_config
    from rlhfkit.inference import batch
    from rlhfkit.rl.reward_group import text_sources

    made = []

    class Recorded:  # batch.score scores with a stand-in; the tests call the real client
        name = "recorded"

        def __call__(self, texts, prompts, labels):
            return SimpleNamespace(rewards=torch.zeros(len(texts)))

    def record(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return Recorded()

    real = sources.reward_source_from_config
    sources.reward_source_from_config = record
    try:
        bi = parse_config("batch-inference", BI_GROUPS, flags_to_argv({"remote_rm_url": url, **flags}))
        batch.score(bi, [{"input": "q", "output": "a"}], {})
    finally:
        sources.reward_source_from_config = real
    ppo = parse_config("ppo", PPO_GROUPS, flags_to_argv({"remote_rm_url": url, **flags}))
    return [text_sources(ppo)[0], *made]


def test_remote_rm_token_flag_authenticates(monkeypatch):
    """--remote_rm_token is the bearer token serve-rm --auth_token asks for (else env RLHFKIT_RM_TOKEN)."""
    monkeypatch.delenv("RLHFKIT_RM_TOKEN", raising=False)
    with serving(RewardServer(index_reward(1.0), "127.0.0.1", 0, token="s3cret")) as url:
        for source in flag_clients(url, remote_rm_token="s3cret", remote_rm_backoff=0.01):
            assert source(QUERIES).rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        for source in flag_clients(url, remote_rm_backoff=0.01):
            with pytest.raises(RemoteRewardError, match="401"):
                source(QUERIES)
        monkeypatch.setenv("RLHFKIT_RM_TOKEN", "s3cret")
        for source in flag_clients(url):
            assert source(QUERIES).rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_remote_rm_retries_and_backoff_flags_space_the_attempts():
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Unavailable,), {"posts": 0}))
    server.daemon_threads = True
    with serving(server) as url:
        handler = server.RequestHandlerClass
        for source in flag_clients(url, remote_rm_retries=2, remote_rm_backoff=0.2):
            handler.posts = 0
            start = time.monotonic()
            with pytest.raises(RemoteRewardError, match="3 of 3 attempt.*HTTP 503"):
                source(QUERIES)
            assert handler.posts == 3 and time.monotonic() - start >= 0.2 + 0.4  # waits 0.2 s, then 0.4 s
        for source in flag_clients(url, remote_rm_retries=0):
            handler.posts = 0
            with pytest.raises(RemoteRewardError, match="1 of 1 attempt"):
                source(QUERIES)
            assert handler.posts == 1


def test_remote_rm_timeout_flag_bounds_each_request():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)  # answers after 1.5 s
    server.daemon_threads = True
    with serving(server) as url:
        for source in flag_clients(url, remote_rm_timeout=0.3, remote_rm_retries=0, reward_timeout=30):
            start = time.monotonic()
            with pytest.raises(RemoteRewardError, match=r"deadline 0.3 s.*timed out"):
                source(QUERIES)
            assert time.monotonic() - start < 1.2
        # unset, a request gets --reward_timeout (a request always has a deadline: 60 s when that is 0)
        assert [s.timeout for s in flag_clients(url, reward_timeout=0.4)] == [0.4, 0.4]
        assert [s.timeout for s in flag_clients(url, reward_timeout=0)] == [60.0, 60.0]


class LargeAnswer(BaseHTTPRequestHandler):
    """A valid answer padded with 2 MiB of extra_logs."""

    def do_POST(self):  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
        body = json.dumps({"rewards": [1.0] * n, "extra_logs": {"pad": ["x" * (2 << 20) + str(i) for i in
                                                                        range(n)]}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_rm_max_response_mb_flag_caps_the_answer():
    """The default cap (64 MiB) takes a 2 MiB answer; --remote_rm_max_response_mb 1 refuses it unread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), LargeAnswer)
    server.daemon_threads = True
    with serving(server) as url:
        for source in flag_clients(url, remote_rm_retries=0):
            assert source(QUERIES[:1]).rewards.tolist() == [1.0]
        for source in flag_clients(url, remote_rm_max_response_mb=1, remote_rm_retries=0):
            assert source.max_response_bytes == 1 << 20
            with pytest.raises(RemoteRewardError, match=r"exceeds the cap of 1048576 bytes "
                                                        r"\(--remote_rm_max_response_mb\); not read"):
                source(QUERIES[:1])
