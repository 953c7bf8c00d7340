"""free_port: a rendezvous port that an outgoing connection cannot take before the rendezvous binds it."""

from __future__ import annotations

import socket

from rlhfkit.engine.distributed import ephemeral_port_range, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable_on_every_address():
    low, high = ephemeral_port_range()
    assert 1024 <= low < high
    ports = {free_port() for _ in range(8)}
    assert all(1024 <= p < low for p in ports)  # bind(0) would give one inside [low, high]
    assert len(ports) > 1  # drawn at random, not one fixed port for every group
    for port in ports:
        for address in ("", "127.0.0.1"):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((address, port))


def test_a_taken_port_is_not_returned(monkeypatch):
    import random

    from rlhfkit.engine import distributed

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("", 0))
    busy = taken.getsockname()[1]
    draws = iter([busy, busy])
    monkeypatch.setattr(random.Random, "randrange", lambda self, a, b: next(draws, a + 7))
    monkeypatch.setattr(distributed, "ephemeral_port_range", lambda: (busy + 1, busy + 100))
    try:
        assert free_port() not in (busy,)
    finally:
        taken.close()
