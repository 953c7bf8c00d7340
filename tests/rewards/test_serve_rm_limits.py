"""serve-rm against misbehaving clients over real sockets on 127.0.0.1: stalled and byte-dripping clients, oversized
and unauthenticated requests (refused before the body is read), the connection cap, merged batches and dropped work
of clients that have gone, and the refusal of a non-loopback --host without a token."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import rlhfkit.rewards.server as server_module
from rlhfkit.errors import ConfigError, RemoteRewardError
from rlhfkit.rewards.base import RewardOutput
from rlhfkit.rewards.remote import RemoteRewardClient
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.server import RewardServer, ServerLimits

pytestmark = pytest.mark.timeout(120)


def last_word_reward(queries, prompts, labels):
    if any("boom" in q for q in queries):
        raise ValueError("cannot grade")
    return {"rewards": [float(q.split()[-1]) for q in queries]}


class GatedSource:
    """A reward source that records every batch it is called with; while ``gate`` is closed its calls wait (so
    requests queue behind the first one)."""

    name = "gated"

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.batches: list[list[str]] = []
        self.inner = RewardFuncSource(last_word_reward, "test:last_word")

    def __call__(self, queries, prompts, labels) -> RewardOutput:
        self.batches.append(list(queries))
        self.entered.set()
        assert self.gate.wait(30)
        return self.inner(queries, prompts, labels)


@contextmanager
def serving(server: RewardServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def flag_server(monkeypatch, source, *flags: str) -> RewardServer:
    """`rlhfkit serve-rm` built from its flags, serving ``source``."""
    monkeypatch.setattr(server_module, "build_reward_source", lambda specs, **kwargs: source)
    return server_module.build_server(["--remote_rm_url", "builtin:exact", "--port", "0", *flags])


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
    return sock


def headers_only(url: str, length: int, extra: str = "", path: str = "/get_reward",
                 method: str = "POST") -> socket.socket:
    """A client that sends a request's headers (announcing ``length`` body bytes) and none of its body."""
    sock = connect(url)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n".encode())
    return sock


def read_answer(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict]:
    """Status and JSON body of the answer on ``sock`` (read until the server closes)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)


def nothing_received(sock: socket.socket) -> bool:
    """No byte (and no close) has arrived on ``sock`` yet."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def good_client(url: str, **kwargs) -> RemoteRewardClient:
    return RemoteRewardClient(url, **{"timeout": 5.0, "retries": 0, "backoff": 0.01, **kwargs})


def test_many_stalled_clients_do_not_starve_a_good_client(monkeypatch):
    """Twenty clients send half their headers and stall; a good client is answered while they all still wait, and
    each stalled one gets 408 once --request_timeout (from its connection, not per read) has passed."""
    source = GatedSource()
    source.gate.set()
    with serving(flag_server(monkeypatch, source, "--request_timeout", "3")) as url:
        stalled = []
        for _ in range(20):
            sock = connect(url)
            sock.sendall(b"POST /get_reward HTTP/1.1\r\nContent-Len")
            stalled.append(sock)
        began = time.monotonic()
        out = good_client(url)(["a 1", "b 2"])
        assert out.rewards.tolist() == [1.0, 2.0] and time.monotonic() - began < 2.0
        assert all(nothing_received(s) for s in stalled)  # still waiting: the good client did not wait for them
        for sock in stalled:
            status, payload = read_answer(sock)
            assert status == 408 and "--request_timeout" in payload["error"]
            sock.close()
        assert time.monotonic() - began < 8.0


def test_a_byte_dripping_client_is_cut_off_at_the_request_deadline(monkeypatch):
    """A client that sends one header byte every 0.1 s never lets a per-read timeout fire; the request deadline is
    a total and cuts it off after --request_timeout seconds."""
    with serving(flag_server(monkeypatch, GatedSource(), "--request_timeout", "0.8")) as url:
        sock = connect(url)
        began, answered = time.monotonic(), None
        request = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server has closed the connection
                break
            if not nothing_received(sock):
                answered = time.monotonic() - began
                break
            time.sleep(0.1)
        assert answered is not None and 0.7 <= answered < 2.0, answered
        status, payload = read_answer(sock)
        assert status == 408 and "0.8 s" in payload["error"]
        sock.close()


def test_oversized_request_is_refused_before_its_body_is_read(monkeypatch):
    """A Content-Length over --max_request_mb gets 413 while the client has sent only its headers: the server
    answered without the body, so it cannot have read it. The default cap (256 MiB) holds too."""
    source = GatedSource()
    source.gate.set()
    with serving(flag_server(monkeypatch, source, "--max_request_mb", "0.001")) as url:  # 1048 bytes
        body = json.dumps({"query": ["a 1"]}).encode()
        sock = headers_only(url, 2000)
        status, payload = read_answer(sock, timeout=2.0)
        assert status == 413 and "--max_request_mb" in payload["error"] and "2000 bytes" in payload["error"]
        sock.close()
        sock = headers_only(url, len(body))  # under the cap: the body is read and scored
        sock.sendall(body)
        status, payload = read_answer(sock)
        assert status == 200 and payload["rewards"] == [1.0]
        sock.close()
    with serving(RewardServer(source, "127.0.0.1", 0)) as url:
        sock = headers_only(url, 300 * 1024 * 1024)
        assert read_answer(sock, timeout=2.0)[0] == 413
        sock.close()
    assert source.batches == [["a 1"]]


def test_token_path_and_method_are_checked_before_the_body(monkeypatch):
    """Wrong or missing token: 401; unknown path: 404; GET on the endpoint: 405 - all answered to a client that has
    sent only headers, and nothing reaches the reward source."""
    monkeypatch.delenv("RLHFKIT_RM_TOKEN", raising=False)
    source = GatedSource()
    source.gate.set()
    with serving(RewardServer(source, "127.0.0.1", 0, token="s3cret")) as url:
        for extra, path, method, status in [
            ("Authorization: Bearer wrong\r\n", "/get_reward", "POST", 401),
            ("", "/get_reward", "POST", 401),
            ("Authorization: Bearer s3cret\r\n", "/score", "POST", 404),
            ("Authorization: Bearer s3cret\r\n", "/get_reward", "GET", 405),
        ]:
            sock = headers_only(url, 10_000, extra, path, method)
            got, payload = read_answer(sock, timeout=2.0)
            assert got == status, (extra, path, method, payload)
            sock.close()
        assert good_client(url, token="s3cret")(["x 3"]).rewards.tolist() == [3.0]
    assert source.batches == [["x 3"]]


def test_connection_cap_answers_503_at_once_and_a_retrying_client_gets_through(monkeypatch):
    """--max_connections 2 with two stalled clients: a third connection is answered 503 (Retry-After) at once; the
    reward client retries 503 and is served once the stalled ones pass their deadline."""
    source = GatedSource()
    source.gate.set()
    with serving(flag_server(monkeypatch, source, "--max_connections", "2", "--request_timeout", "2.5")) as url:
        stalled = [connect(url) for _ in range(2)]
        time.sleep(0.2)  # both accepted
        began = time.monotonic()
        sock = headers_only(url, 10)
        status, payload = read_answer(sock, timeout=2.0)
        assert status == 503 and "--max_connections" in payload["error"] and time.monotonic() - began < 1.5
        sock.close()
        with pytest.raises(RemoteRewardError, match="HTTP 503"):
            good_client(url)(["a 1"])
        assert good_client(url, retries=4, backoff=0.4)(["a 1"]).rewards.tolist() == [1.0]  # waits 0.4 .. 3.2 s
        for sock in stalled:
            sock.close()


def post_in_thread(url: str, queries: list[str], results: dict, key: str) -> threading.Thread:
    def run():
        try:
            results[key] = good_client(url, timeout=30)(queries).rewards.tolist()
        except RemoteRewardError as err:
            results[key] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_queued(server: RewardServer, n: int) -> None:
    deadline = time.monotonic() + 10
    while server.batcher is None or len(server.batcher) < n:
        assert time.monotonic() < deadline, f"{n} requests never queued"
        time.sleep(0.02)


def test_queued_requests_are_merged_and_work_of_gone_clients_dropped(monkeypatch):
    """While a batch is scored, three requests queue; the one whose client closed its connection is dropped, the
    other two are scored together as the next batch and each gets its own rewards."""
    source = GatedSource()
    server = flag_server(monkeypatch, source)
    with serving(server) as url:
        results: dict = {}
        threads = [post_in_thread(url, ["a 1", "b 2"], results, "first")]
        assert source.entered.wait(10)
        body = json.dumps({"query": ["gone 7"]}).encode()
        gone = headers_only(url, len(body))
        gone.sendall(body)
        wait_queued(server, 1)
        gone.close()  # gives up while queued
        threads.append(post_in_thread(url, ["c 3"], results, "second"))
        wait_queued(server, 2)
        threads.append(post_in_thread(url, ["d 4", "e 5"], results, "third"))
        wait_queued(server, 3)
        time.sleep(0.3)  # the close reaches the server
        source.gate.set()
        for thread in threads:
            thread.join(30)
        assert results == {"first": [1.0, 2.0], "second": [3.0], "third": [4.0, 5.0]}
        assert source.batches == [["a 1", "b 2"], ["c 3", "d 4", "e 5"]]  # "gone 7" was never scored
        assert server.batcher is not None and server.batcher.requests_dropped == 1


def test_batch_max_queries_caps_the_merged_batch(monkeypatch):
    """--batch_max_queries 3: queued requests of 2, 1 and 2 queries become batches [2 + 1] and [2]; 0 never merges."""
    for cap, expected in [("3", [["a 1"], ["b 2", "c 3", "d 4"], ["e 5", "f 6"]]),
                          ("0", [["a 1"], ["b 2", "c 3"], ["d 4"], ["e 5", "f 6"]])]:
        source = GatedSource()
        server = flag_server(monkeypatch, source, "--batch_max_queries", cap)
        with serving(server) as url:
            results: dict = {}
            threads = [post_in_thread(url, ["a 1"], results, "0")]
            assert source.entered.wait(10)
            for i, queries in enumerate([["b 2", "c 3"], ["d 4"], ["e 5", "f 6"]], start=1):
                threads.append(post_in_thread(url, queries, results, str(i)))
                wait_queued(server, i)
            source.gate.set()
            for thread in threads:
                thread.join(30)
        assert source.batches == expected, cap
        assert results == {"0": [1.0], "1": [2.0, 3.0], "2": [4.0], "3": [5.0, 6.0]}


def test_a_failing_merged_batch_is_rescored_one_request_at_a_time(monkeypatch):
    """A reward_func error in one queued request costs that request (422 naming its own sample 1), not the request
    merged with it."""
    source = GatedSource()
    server = flag_server(monkeypatch, source)
    with serving(server) as url:
        results: dict = {}
        threads = [post_in_thread(url, ["a 1"], results, "first")]
        assert source.entered.wait(10)
        threads.append(post_in_thread(url, ["b 2"], results, "good"))
        wait_queued(server, 1)
        threads.append(post_in_thread(url, ["c 3", "boom 4"], results, "bad"))
        wait_queued(server, 2)
        source.gate.set()
        for thread in threads:
            thread.join(30)
    assert results["first"] == [1.0] and results["good"] == [2.0]
    assert isinstance(results["bad"], RemoteRewardError)
    assert re.search(r"HTTP 422.*sample 1 .*boom 4", str(results["bad"])), str(results["bad"])
    assert source.batches == [["a 1"], ["b 2", "c 3", "boom 4"], ["b 2"], ["c 3", "boom 4"]]


def test_a_non_loopback_host_without_a_token_is_refused(monkeypatch, caplog, capsys):
    """`serve-rm --remote_rm_url builtin:code --host 0.0.0.0` would run anyone's code: refused with the flags to
    use; a token (flag or env) or --allow_unauthenticated (with a loud warning) lets it bind."""
    from rlhfkit.cli.main import main

    monkeypatch.delenv("RLHFKIT_RM_TOKEN", raising=False)
    argv = ["--remote_rm_url", "builtin:code", "--host", "0.0.0.0", "--port", "0"]
    with pytest.raises(ConfigError) as info:
        server_module.build_server(argv)
    for flag in ("--host '0.0.0.0'", "--auth_token", "RLHFKIT_RM_TOKEN", "--allow_unauthenticated", "127.0.0.1"):
        assert flag in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-rm", *argv])
    assert exit_info.value.code == 2 and "--allow_unauthenticated" in capsys.readouterr().err
    for extra, env in [(["--auth_token", "s3cret"], None), ([], "s3cret"), (["--allow_unauthenticated"], None)]:
        if env:
            monkeypatch.setenv("RLHFKIT_RM_TOKEN", env)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhfkit.rewards.server"):
            server = server_module.build_server(argv + extra)
        try:
            assert server.server_address[0] == "0.0.0.0"
            warned = "SERVING WITHOUT A TOKEN" in caplog.text
            assert warned == (extra == ["--allow_unauthenticated"]), caplog.text
        finally:
            server.server_close()
        monkeypatch.delenv("RLHFKIT_RM_TOKEN", raising=False)
    # loopback needs no token; a name that resolves to loopback counts as loopback
    for host in ("127.0.0.1", "localhost"):
        server = server_module.build_server(["--remote_rm_url", "builtin:exact", "--host", host, "--port", "0"])
        server.server_close()
    with pytest.raises(ConfigError, match="--request_timeout must be > 0"):
        ServerLimits(request_timeout=0)
