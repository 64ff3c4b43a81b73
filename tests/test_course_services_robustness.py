"""Course services take whatever arrives on their subjects from someone else's code: the gateway and
the email provider answer a request they cannot parse with an error, drop a message nobody waits
for, never raise inside their callbacks (no traceback in the process serving them), and answer the
next well-formed request as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats

from msglab.broker.server import EmbeddedServer
from msglab.world import email_provider as ep
from msglab.world import gateway as gw

# Bytes a careless or hostile learner process might send: not JSON, JSON of the wrong shape,
# numbers no int or clock can take, fields of the wrong type.
GARBAGE = [
    b"",
    b"not json",
    b"\xff\xfe",
    b"[1, 2, 3]",
    b'"a string"',
    b"null",
    b'{"account": "a", "cents": 1e400}',
    b'{"account": "a", "cents": 100000000000000000000000000000}',
    b'{"account": {"x": 1}, "cents": "12"}',
    b'{"reference": ["x"]}',
    b'{"seconds": "abc"}',
    b'{"seconds": NaN}',
    b'{"seconds": -1e400}',
    b'{"to": 5, "template": ["x"]}',
    b'{"to": "a@b.example", "template": "order_confirmation", "order_id": {"nested": [1]}}',
    b'{"op": "outage", "seconds": "forever"}',
    b'{"op": "script", "address": 1, "answers": 5}',
    b'{"op": ["x"]}',
    b'{"op": "nope"}',
]


async def _serve_and_poke(url: str, serve: Any, subjects: list[str], valid: tuple[str, bytes]) -> dict[str, Any]:
    """Serve a service on a connection that records every error its callbacks raise; poke it; then ask once properly."""
    raised: list[str] = []

    async def on_error(exc: Exception) -> None:
        raised.append(repr(exc))

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: raised.append(str(context.get("exception") or context)))
    server_nc = await nats.connect(url, error_cb=on_error)
    client = await nats.connect(url)
    service = await serve(server_nc)
    replies = []
    for subject in subjects:
        for data in GARBAGE:
            await client.publish(subject, data)  # nobody waits for an answer to these
            reply = await client.request(subject, data, timeout=2)
            replies.append(reply.data)
    answer = await client.request(*valid, timeout=2)
    await client.flush()
    await server_nc.flush()
    await service.stop()
    await client.close()
    await server_nc.close()
    return {"raised": raised, "replies": replies, "answer": answer.data}


def test_the_gateway_answers_garbage_with_errors_and_never_raises(server: EmbeddedServer, tmp_path: Path) -> None:
    async def serve(nc: Any) -> Any:
        return await gw.attach(nc, str(tmp_path / "gateway.sqlite"), prefix="g")

    valid = ("g.charge", b'{"account": "acct-1", "cents": 1250, "reference": "p-1"}')
    seen = asyncio.run(_serve_and_poke(server.url, serve, ["g.charge", "g.search", "g.test_clock"], valid))
    assert seen["raised"] == []
    assert len(seen["replies"]) == 3 * len(GARBAGE) and all(b"error" in r for r in seen["replies"][:7])
    assert b"charge_id" in seen["answer"]


def test_the_email_provider_answers_garbage_with_errors_and_never_raises(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def serve(nc: Any) -> Any:
        return await ep.attach(nc, str(tmp_path / "provider.sqlite"), prefix="p")

    valid = ("p.send", b'{"to": "a@b.example", "template": "order_confirmation", "order_id": "o-1"}')
    seen = asyncio.run(_serve_and_poke(server.url, serve, ["p.send", "p.control"], valid))
    assert seen["raised"] == []
    assert len(seen["replies"]) == 2 * len(GARBAGE)
    assert b"message_id" in seen["answer"]
    provider = ep.ProviderView(str(tmp_path / "provider.sqlite"), "p")
    # Every request that was waited for is in the store; none of the ones nobody waited for is.
    assert len(provider.requests()) == len(GARBAGE) + 1


def test_a_service_process_is_told_its_server_on_stdin_so_no_password_shows_in_its_command_line(
    server: EmbeddedServer,
) -> None:
    # A classroom URL carries the learner's password, and any user of the machine may read a command line.
    gateway, provider = gw.start(server.url), ep.start(server.url)
    try:
        for proc in (gateway, provider):
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert proc.alive and not any(b"nats://" in arg or b"tls://" in arg for arg in argv), argv
    finally:
        gateway.stop(remove=True)
        provider.stop()
