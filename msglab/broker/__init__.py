"""Which NATS server the course talks to, and connecting to it.

One rule everywhere: if NATS_URL is set, use that server and start nothing. Otherwise `make lab`
has started one and put its address in NATS_URL for every notebook; a kernel started any other
way (VS Code, plain `jupyter lab`) uses the classroom account `msglab join` saved, if any, or else
gets its own server on demand, stopped when the kernel exits.

A classroom server may speak TLS with a CA of its own (`classroom serve --tls`). Every connection
the course opens checks the server's certificate (never with verification off) against NATS_CA
when set (a PEM file, or the PEM itself: the nats CLI's variable), else against the CA `msglab
join` saved, for that server; otherwise against the system's CAs. With a room's CA the connection
starts with the TLS handshake whatever the URL's scheme, so nothing crosses in clear even if
someone on the path answers with a greeting that does not ask for TLS. `tls_options(url)` gives
the nats.connect options that do it; `connect` uses them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from msglab.broker.server import EmbeddedServer
from msglab.errors import MsglabError, ServerUnreachable

CA_VARIABLE = "NATS_CA"
# A msglab TLS room answers a TLS handshake at once (nats-server's handshake_first, falling back to
# INFO after 1 s for clients that wait for it). A client that starts with the handshake sends
# nothing in clear, and nobody on the path can strip the server's tls_required from its INFO: nats-py
# upgrades only because INFO asks it to, whatever the URL's scheme. So whenever a room's CA is known
# for a server, the course starts with the handshake, nats:// or tls:// alike.
HANDSHAKE_FIRST = {"tls_handshake_first": True}
ROOM_CA_NAME = "msglab classroom CA"  # the common name's start of every room's CA: that server is a msglab room
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----")
_shared: EmbeddedServer | None = None


@dataclass(frozen=True)
class ServerInfo:
    """Where the server is, who started it, and which binary."""

    url: str
    origin: str  # "NATS_URL" or "embedded (started by this process)"
    version: str | None
    binary: str | None

    def describe(self) -> str:
        version = f"nats-server {self.version}" if self.version else "nats-server (version unknown until connected)"
        binary = f", binary from {self.binary}" if self.binary else ""
        return f"{version} at {masked(self.url)} ({self.origin}{binary})"


def server_info() -> ServerInfo:
    """Return the server this process uses, starting an embedded one if there is none yet."""
    global _shared
    url = os.environ.get("NATS_URL")
    if url:
        return ServerInfo(
            url,
            "NATS_URL",
            os.environ.get("MSGLAB_SERVER_VERSION"),
            os.environ.get("MSGLAB_SERVER_BINARY"),
        )
    joined = _joined_url()
    if joined:
        return ServerInfo(joined, "your classroom account, from `msglab join`", None, None)
    if _shared is None or _shared.proc is None or _shared.proc.poll() is not None:
        _shared = EmbeddedServer().start()
    return ServerInfo(_shared.url, "embedded (started by this process)", _shared.version, _shared.binary.source)


def _joined_url() -> str | None:
    from msglab.classroom.join import joined_url

    return joined_url()


def server_url() -> str:
    """The URL of the server this process uses (see server_info)."""
    return server_info().url


def probe(url: str, timeout: float = 1.0) -> None:
    """Raise ServerUnreachable unless something accepts TCP connections at url."""
    first = url.split(",")[0].strip()
    parsed = urlparse(first if "://" in first else f"nats://{first}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise ServerUnreachable(f"no NATS server answers at {masked(first)} ({exc.strerror or exc})") from exc


def certificates_in(text: str) -> str:
    """The PEM certificates in `text` (a handout holds words around them), joined; "" if none."""
    return "\n".join(match.group(0) for match in _PEM.finditer(text))


def trusted_ca(url: str | None = None) -> str | None:
    """The PEM of the CA to check `url`'s server against: NATS_CA, else the joined room's for its server; or None."""
    given = os.environ.get(CA_VARIABLE, "").strip()
    if given:
        text = given
        if "-----BEGIN" not in given:
            try:
                text = Path(given).expanduser().read_text(encoding="ascii", errors="replace")
            except OSError as exc:
                said = f"{CA_VARIABLE}={given} cannot be read: {exc.strerror or exc}"
                raise MsglabError(said, hint="set NATS_CA to the room's CA certificate (ca.pem), or unset it") from exc
        pem = certificates_in(text)
        if not pem:
            raise MsglabError(f"{CA_VARIABLE}={given[:60]} holds no PEM certificate",
                              hint="set NATS_CA to the room's CA certificate (ca.pem), or unset it")  # fmt: skip
        return pem
    try:
        from msglab.classroom.join import joined_ca, joined_url
    except ImportError:  # a graded learner process (msglab.classroom sealed) knows its CA from NATS_CA alone
        return None
    joined = joined_url()
    if joined and (url is None or _server_of(url) == _server_of(joined)):
        return joined_ca()
    return None


def _server_of(url: str) -> tuple[str, int]:
    first = url.split(",")[0].strip()
    parsed = urlparse(first if "://" in first else f"nats://{first}")
    return (parsed.hostname or "").lower(), parsed.port or 4222


class _QuietTLSClose(logging.Filter):
    """asyncio warns at every TLS connection nats-py closes (its stream protocol asks to keep the socket half open,
    which TLS cannot): harmless, and a lesson's output would show it after each cell."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


def tls_context(pem: str) -> ssl.SSLContext:
    """An SSL context that trusts only the CA in `pem`, hostname and chain checked."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietTLSClose) for f in asyncio_log.filters):
        asyncio_log.addFilter(_QuietTLSClose())
    try:
        return ssl.create_default_context(cadata=pem)
    except ssl.SSLError as exc:
        raise MsglabError(f"the room's CA certificate cannot be used: {exc}",
                          hint="ask your instructor for the handout again") from exc  # fmt: skip


def is_room_ca(context: ssl.SSLContext) -> bool:
    """Whether `context` trusts a room's CA (`classroom serve --tls`): that server takes the handshake first."""
    subjects: list[Any] = [cert.get("subject", ()) for cert in context.get_ca_certs()]
    names = [str(value) for subject in subjects for rdn in subject for key, value in rdn if key == "commonName"]
    return any(name.startswith(ROOM_CA_NAME) for name in names)


def _room_url(url: str | None) -> bool:
    """Whether `url` names the room a known room CA is for: tls://, or the server NATS_URL or the join names.

    NATS_CA holds for any server, but the servers msglab starts for itself (a grading run's, a kernel's) speak
    no TLS: only the room's server is asked for the handshake first.
    """
    if not url:
        return False
    if url.strip().startswith("tls://"):
        return True
    rooms = [os.environ.get("NATS_URL", "")]
    try:
        from msglab.classroom.join import joined_url

        rooms.append(joined_url() or "")
    except ImportError:  # a graded learner process: msglab.classroom sealed
        pass
    return _server_of(url) in {_server_of(room) for room in rooms if room}


def tls_options(url: str | None = None, ca: str | None = None) -> dict[str, Any]:
    """nats.connect options that check `url`'s server against `ca` (PEM; default: trusted_ca), or {}.

    A connection that does not end up TLS ignores them; without them nats-py checks against the system's CAs.
    """
    pem = ca or trusted_ca(url)
    if not pem:
        return {}
    context = tls_context(pem)
    if is_room_ca(context) and _room_url(url):
        return {"tls": context, **HANDSHAKE_FIRST}  # a room msglab serves, whatever the URL's scheme
    return {"tls": context}


async def connect(url: str | None = None, *, name: str = "msglab", **options: Any) -> Any:
    """Connect to the course's server (or url) and return the nats.NATS client.

    Fails within a few seconds with ServerUnreachable instead of retrying for minutes.
    """
    import nats  # imported here: `import msglab` stays cheap
    from nats.aio.client import _default_error_callback

    url = url or server_url()
    probe(url)
    options.setdefault("connect_timeout", 2)
    for key, value in tls_options(url).items():
        options.setdefault(key, value)
    # nats-py retries a failed TLS handshake like a dropped line, printing a traceback each time (its default
    # error_cb): stop at the first, and say only the course's message.
    refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    passed_on = options.get("error_cb") or _default_error_callback
    connected = False
    handshake_first = bool(options.get("tls_handshake_first"))

    async def error_cb(exc: Exception) -> None:
        if isinstance(exc, ssl.SSLError) and getattr(exc, "reason", None) == "APPLICATION_DATA_AFTER_CLOSE_NOTIFY":
            return  # a TLS connection closing while the server still writes: nothing was lost that was asked for
        # A server that does not take the handshake (a greeting in clear instead) times it out or hangs up.
        handshake = isinstance(exc, ssl.SSLError) or (handshake_first and isinstance(exc, OSError))
        if not connected and handshake:
            if not refused.done():
                refused.set_result(exc)
            if passed_on is _default_error_callback:
                return
        await passed_on(exc)

    options["error_cb"] = error_cb
    connecting: asyncio.Future[Any] = asyncio.ensure_future(nats.connect(url, name=name, **options))
    try:
        await asyncio.wait([connecting, refused], timeout=5, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            await asyncio.wait([connecting])  # gone before we say why (its own error says less)
            said = refused.result() if refused.done() else TimeoutError()
            if isinstance(said, ssl.SSLError) or not refused.done():
                raise said
            raise ssl.SSLError(f"no answer to it: {type(said).__name__}") from said
        nc = connecting.result()
        connected = True
        return nc
    except ssl.SSLCertVerificationError as exc:
        raise ServerUnreachable(
            f"the TLS certificate of the server at {masked(url)} does not check out against the CA this course "
            f"trusts for it ({exc.verify_message})",
            hint="join with the handout your instructor gave you (it holds the room's certificate), "
            "or set NATS_CA to the room's ca.pem",
        ) from exc
    except ssl.SSLError as exc:
        raise ServerUnreachable(
            f"the server at {masked(url)} did not complete a TLS handshake ({getattr(exc, 'reason', None) or exc})"
            + (
                "; the course knows a TLS room's CA for it, so nothing went to it in clear"
                if options.get("tls_handshake_first")
                else ""
            ),
            hint="check the address with your instructor (a room's server always takes the handshake), "
            "or unset NATS_CA if this is not the room's server",
        ) from exc
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise ServerUnreachable(f"could not open a NATS connection to {masked(url)}: {exc!r}") from exc
    finally:
        connecting.cancel()  # the caller cancelled us: nothing keeps connecting behind its back


async def connect_js(url: str | None = None, **options: Any) -> tuple[Any, Any]:
    """Connect and return (nc, js): the connection and its JetStream context."""
    nc = await connect(url, **options)
    return nc, nc.jetstream()


async def delete_stream(js: Any, name: str) -> bool:
    """Delete stream `name` (and its consumers) if it exists; True if there was one.

    The stream is purged first. nats-server (2.15.1 at least) answers a delete before it has
    removed the stream's files, and a stream created again at once under the same name can
    pick those files up: without the purge a re-run after an aborted one could find the old
    run's messages in its "new" stream.
    """
    from nats.js.errors import NotFoundError

    try:
        await js.purge_stream(name)
        return bool(await js.delete_stream(name))
    except NotFoundError:
        return False


async def delete_streams(js: Any, prefix: str) -> list[str]:
    """Delete every stream whose name starts with `prefix`; return their names."""
    names = [info.config.name for info in await js.streams_info() if info.config.name.startswith(prefix)]
    for name in names:
        await delete_stream(js, name)
    return names


async def settle_subscriptions(nc: Any) -> None:
    """Return only once the server has every SUB this connection sent so far.

    One `nc.flush()` is not enough in nats-py 2.16: flush writes its PING straight to the socket
    while a fresh SUB still waits in the client's pending buffer, so the PONG can come back
    before the server knows the subscription (seen here as a NoRespondersError on a request to
    a subject that had just been subscribed and flushed). The first flush lets the flusher task
    write the buffer; the second PING then travels behind the SUB.
    """
    await nc.flush()
    await nc.flush()


def masked(url: str) -> str:
    """The URL with its password hidden (a lesson's output may be on a projector)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)
