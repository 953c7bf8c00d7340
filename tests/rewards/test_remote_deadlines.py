"""The reward client against real misbehaving HTTP servers started here on 127.0.0.1: answers dripped a byte at a
time (status line, headers or body), huge answers (announced or streamed), refused connections, 500s and failover
between the replicas of a reward group, and the jittered exponential backoff between rounds."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhfkit.errors import RemoteRewardError
from rlhfkit.rewards.remote import RemoteRewardClient
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.server import RewardServer, ServerLimits

pytestmark = pytest.mark.timeout(120)
QUERIES = [f"q {i}" for i in range(6)]


class Handler(BaseHTTPRequestHandler):
    """Base of the misbehaving servers: reads the request, records when it came, then ``answer()``."""

    protocol_version = "HTTP/1.1"
    posts: list[float]
    queries: list[list[str]]

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posts.append(time.monotonic())
        type(self).queries.append(body["query"])
        try:
            self.answer(body["query"])
        except OSError:
            pass  # the client cut us off

    def answer(self, queries):
        raise NotImplementedError

    def log_message(self, *args):
        pass


class Good(Handler):
    def answer(self, queries):
        body = json.dumps({"rewards": [float(q.split()[-1]) for q in queries]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Fails500(Handler):
    def answer(self, queries):
        self.send_response(500)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


class DripHeaders(Handler):
    """Sends the status line and headers one byte every 0.15 s (a per-read timeout of 0.5 s never fires)."""

    def answer(self, queries):
        body = json.dumps({"rewards": [0.0] * len(queries)}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nX-Pad: {'a' * 60}\r\n\r\n".encode()
        for byte in head:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.15)
        self.wfile.write(body)


class DripBody(Handler):
    """Sends the headers at once, then the body one byte every 0.15 s."""

    def answer(self, queries):
        body = json.dumps({"rewards": [0.0] * len(queries), "extra_logs": {"pad": ["x" * 20] * len(queries)}})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for char in body.encode():
            self.wfile.write(bytes([char]))
            self.wfile.flush()
            time.sleep(0.15)


class HugeAnnounced(Handler):
    """Announces a 1 GiB answer and sends the first MiB of it."""

    def answer(self, queries):
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 30))
        self.end_headers()
        self.wfile.write(b" " * (1 << 20))


class HugeStreamed(Handler):
    """A chunked answer with no Content-Length that never ends (blank space before the JSON)."""

    def answer(self, queries):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b" " * 65536
        for _ in range(1 << 14):  # up to 1 GiB
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))


def make(handler: type[Handler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type(handler.__name__, (handler,), {"posts": [], "queries": []}))
    server.daemon_threads = True
    return server


@contextmanager
def serving(server) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/get_reward"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"


def client(urls, **kwargs) -> RemoteRewardClient:
    return RemoteRewardClient(urls, **{"timeout": 5.0, "retries": 0, "backoff": 0.01, **kwargs})


@pytest.mark.parametrize("handler", [DripHeaders, DripBody])
def test_a_dripping_server_is_cut_off_at_the_request_deadline(handler):
    """A byte every 0.15 s keeps every read under 0.5 s; the deadline is the request's wall time, so the attempt
    fails at 0.5 s (the old per-read timeout answered after 5.6 s)."""
    server = make(handler)
    with serving(server) as url:
        began = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"timed out: no complete answer within the 0.5 s deadline"):
            client(url, timeout=0.5)(QUERIES)
        assert 0.45 <= time.monotonic() - began < 1.5
        assert len(server.RequestHandlerClass.posts) == 1


@pytest.mark.parametrize("handler, reason", [
    (HugeAnnounced, r"answer of 1073741824 bytes exceeds the cap of 1048576 bytes.*not read"),
    (HugeStreamed, r"answer longer than the cap of 1048576 bytes.*cut off"),
])
def test_a_huge_answer_is_refused_at_the_cap(handler, reason):
    with serving(make(handler)) as url:
        began = time.monotonic()
        with pytest.raises(RemoteRewardError, match=reason):
            client(url, max_response_bytes=1 << 20)(QUERIES)
        assert time.monotonic() - began < 4.0


def test_a_dead_replica_is_skipped_and_its_shard_scored_by_another():
    """Two URLs, the first refusing connections: its shard fails over to the second, the batch is whole and in
    order; the dead one is then marked down and gets no shard of the next batch."""
    good = make(Good)
    dead = refused_url()
    with serving(good) as url:
        source = client([dead, url])
        assert source(QUERIES).rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        handler = good.RequestHandlerClass
        assert sorted(handler.queries) == [QUERIES[:3], QUERIES[3:]]  # its own shard and the failed-over one
        handler.queries.clear()
        assert source(QUERIES).rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert handler.queries == [QUERIES]  # one request: the dead replica got no shard
        assert source.urls_by_health() == [url, dead]


def test_a_replica_answering_500_fails_over():
    failing, good = make(Fails500), make(Good)
    with serving(failing) as bad_url, serving(good) as good_url:
        source = client([bad_url, good_url])
        assert source(QUERIES).rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert failing.RequestHandlerClass.queries == [QUERIES[:3]]
        assert source(QUERIES[:2]).rewards.tolist() == [0.0, 1.0]
        assert len(failing.RequestHandlerClass.queries) == 1  # marked down: not asked again


def test_when_every_replica_fails_the_error_names_each_url():
    failing, dripping = make(Fails500), make(DripBody)
    dead = refused_url()
    with serving(failing) as bad_url, serving(dripping) as slow_url:
        with pytest.raises(RemoteRewardError) as info:
            client([dead, bad_url, slow_url], timeout=0.4, retries=1)(QUERIES[:1])
    message = str(info.value)
    assert message.startswith("all 3 reward servers failed after 6 of 6 attempt(s)"), message
    assert re.search(re.escape(dead) + r": ConnectionRefusedError", message), message
    assert re.search(re.escape(bad_url) + r": HTTP 500", message), message
    assert re.search(re.escape(slow_url) + r": timed out", message), message


def test_rounds_wait_with_jittered_exponential_backoff():
    """retries 3, backoff 0.2: waits of 0.2, 0.4, 0.8 s each stretched by a factor drawn from [1, 1.5)."""
    failing = make(Fails500)
    with serving(failing) as url:
        source = client(url, retries=3, backoff=0.2)
        with pytest.raises(RemoteRewardError, match="4 of 4 attempt"):
            source(QUERIES[:1])
    posts = failing.RequestHandlerClass.posts
    gaps = [b - a for a, b in zip(posts, posts[1:])]
    for gap, nominal in zip(gaps, (0.2, 0.4, 0.8)):
        assert nominal <= gap < 1.5 * nominal + 0.15, gaps
    draws = [source.backoff_delay(1) for _ in range(300)]
    assert 0.4 <= min(draws) < 0.45 and 0.55 < max(draws) < 0.6  # spread over [0.4, 0.6)


def test_an_early_refusal_is_read_even_when_the_body_was_not():
    """serve-rm refuses a body over --max_request_mb before reading it; the client reads that 413 (not a broken
    pipe) and does not retry it."""
    source = RewardFuncSource(lambda q, p, labels: [0.0] * len(q), "test:zero")
    server = RewardServer(source, "127.0.0.1", 0, limits=ServerLimits(max_body_bytes=1 << 20))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RemoteRewardError, match=r"refused the batch after 1 of 3 attempt.*HTTP 413"):
            client(server.url, retries=2)(["x" * (2 << 20)])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
