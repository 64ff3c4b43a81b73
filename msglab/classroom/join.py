"""`msglab join <details>`: use a classroom server's account for the lessons and lab notebooks.

<details> is what the instructor handed out: the URL with credentials
(nats://alice:...@10.0.0.5:4222), or the file holding it (learners/alice.txt, a JSON file with a
"url"). `join` connects, makes sure JetStream answers on that account, and saves the URL in the
course's state folder (`.msglab/classroom.json`, or MSGLAB_STATE_DIR; mode 0600).

A TLS room's handout (`tls://...`) also holds the room's CA certificate (or `--ca FILE` names it):
`join` checks the server against it (never with verification off) and keeps it beside the URL
(`room-ca.pem`), so every connection the course opens to that server checks it too, starting with the
TLS handshake. With a room's CA known (given, in the handout, or already kept for that server) a
nats:// URL is saved as tls://: nobody on the path can talk a later connection out of TLS.

From then on `msglab.server_url()` (what lessons and lab notebooks connect to) uses it whenever
NATS_URL is not set; NATS_URL still wins. `msglab check` grades on a fresh server of its own as
always (set NATS_URL to grade on the room's server instead: names are then prefixed with a run id
inside your account). `msglab join --leave` forgets the details.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from msglab.errors import MsglabError

FILE = "classroom.json"
CA_FILE = "room-ca.pem"
_URL = re.compile(r"\b(?:nats|tls)://\S+")


def state_file() -> Path:
    from msglab.catalog import course_root

    env = os.environ.get("MSGLAB_STATE_DIR")
    return (Path(env).resolve() if env else course_root() / ".msglab") / FILE


def joined_url() -> str | None:
    """The URL `msglab join` saved, or None (no join, or a file that cannot be read)."""
    try:
        data = json.loads(state_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    url = data.get("url") if isinstance(data, dict) else None
    return url if isinstance(url, str) and url else None


def joined_ca() -> str | None:
    """The room's CA certificate `msglab join` saved (PEM), or None."""
    try:
        data = json.loads(state_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ca = data.get("ca") if isinstance(data, dict) else None
    return ca if isinstance(ca, str) and ca else None


def parse_handout(details: str) -> tuple[str, str | None]:
    """The URL in what the instructor handed out, and the room's CA certificate when the file holds one."""
    from msglab.broker import certificates_in

    text = details.strip()
    path = Path(text).expanduser()
    if not _URL.fullmatch(text) and path.is_file():
        content = path.read_text(encoding="utf-8")
        try:
            data = json.loads(content)
            if isinstance(data, dict) and isinstance(data.get("url"), str):
                return parse_details(data["url"]), certificates_in(str(data.get("ca") or "")) or None
        except ValueError:
            pass
        match = _URL.search(content)
        if not match:
            raise MsglabError(f"{path} holds no nats:// URL", hint="ask your instructor for your classroom details")
        return parse_details(match.group(0)), certificates_in(content) or None
    return parse_details(text), None


def parse_details(details: str) -> str:
    """The URL in what the instructor handed out: the URL itself, or a file that holds it."""
    text = details.strip()
    path = Path(text).expanduser()
    if not _URL.fullmatch(text) and path.is_file():
        return parse_handout(text)[0]
    if not _URL.fullmatch(text):
        raise MsglabError(f"{details!r} is neither a nats:// URL nor a file",
                          hint="msglab join nats://NAME:PASSWORD@HOST:4222 (as handed out)")  # fmt: skip
    parts = urlsplit(text)
    if not parts.username or not parts.password:
        raise MsglabError("the URL holds no user and password", hint="use the whole URL your instructor handed out")
    return text


async def _try(url: str, ca: str | None, ca_from: str) -> dict[str, Any]:
    import ssl

    import nats

    from msglab.broker import HANDSHAKE_FIRST, masked, probe, tls_options
    from msglab.errors import ServerUnreachable

    where = url.split("@")[-1]
    try:
        probe(url)
    except ServerUnreachable as exc:
        raise ServerUnreachable(f"no classroom server answers at {masked(url)}",
                                hint="is the room's server running? ask your instructor") from exc  # fmt: skip
    errors: list[Exception] = []

    async def quiet(exc: Exception) -> None:  # nats-py would print a traceback for each
        errors.append(exc)

    # With the room's CA: only that CA's certificates pass, handshake first. Without: the system's CAs (never no
    # check); a tls:// URL still starts with the handshake, so a greeting that does not ask for TLS gets nothing.
    tls = tls_options(url, ca) if ca else (dict(HANDSHAKE_FIRST) if url.startswith("tls://") else {})
    try:
        nc = await asyncio.wait_for(nats.connect(url, name="msglab-join", allow_reconnect=False, connect_timeout=3,
                                                 error_cb=quiet, **tls), 8)  # fmt: skip
    except Exception as exc:
        first = errors[0] if errors else exc
        if isinstance(first, ssl.SSLCertVerificationError) or isinstance(exc, ssl.SSLCertVerificationError):
            said = first.verify_message if isinstance(first, ssl.SSLCertVerificationError) else str(exc)
            raise MsglabError(
                f"the classroom server at {where} speaks TLS, and its certificate does not check out against "
                f"{ca_from if ca else 'any CA this machine trusts'} ({said})",
                hint="join with the whole file your instructor handed out (it holds the room's certificate), "
                "or add --ca with the room's ca.pem",
            ) from exc
        if isinstance(first, ssl.SSLError) or (tls.get("tls_handshake_first") and isinstance(first, OSError)):
            why = getattr(first, "reason", None) or f"no answer to it: {type(first).__name__}"
            raise MsglabError(
                f"the server at {where} did not complete a TLS handshake ({why}): "
                "your details name a TLS room, so your password was not sent to it",
                hint="check the address with your instructor (is the room's server running there?)",
            ) from exc
        said = str(first).strip() or type(first).__name__
        hint = "copy the whole URL your instructor handed out, or ask for it again"
        raise MsglabError(f"the classroom server at {where} refused these details: {said}", hint) from exc
    try:
        info = await nc.jetstream().account_info()
        version = nc.connected_server_version
        return {"streams": info.streams, "limits": info.limits, "version": f"{version.major}.{version.minor}"}
    finally:
        await nc.close()


def join(details: str, *, check: bool = True, ca_file: str | None = None) -> str:
    """Save the classroom details (after trying them when `check`); return what to tell the learner.

    `ca_file`: the room's CA certificate, when the details themselves do not hold it. With a CA known (there, in the
    handout, in NATS_CA, or saved by an earlier join to the same server) the URL is saved as tls://.
    """
    from msglab.broker import CA_VARIABLE, certificates_in, is_room_ca, tls_context, trusted_ca

    url, ca = parse_handout(details)
    ca_from = "the certificate in your handout"
    if ca_file:
        try:
            ca = certificates_in(Path(ca_file).expanduser().read_text(encoding="ascii", errors="replace"))
        except OSError as exc:
            raise MsglabError(f"--ca {ca_file} cannot be read: {exc.strerror or exc}") from exc
        if not ca:
            raise MsglabError(f"--ca {ca_file} holds no PEM certificate", hint="give the room's ca.pem")
        ca_from = f"the certificate in --ca {ca_file}"
    known = None if ca else trusted_ca(url)
    if known and is_room_ca(tls_context(known)):  # a room's CA already known for this server
        ca = known
        ca_from = (f"the certificate {CA_VARIABLE} names" if os.environ.get(CA_VARIABLE, "").strip()
                   else "the certificate saved when you joined this server before")  # fmt: skip
    if ca:
        tls_context(ca)  # a damaged certificate is said now, not at the first lesson
        if url.startswith("nats://"):
            # With the room's CA known, every connection is TLS: saved so, a plain URL cannot undo it later.
            url = "tls://" + url[len("nats://") :]
    told = ""
    if check:
        try:
            seen = asyncio.run(_try(url, ca, ca_from))
        except MsglabError:
            raise
        except Exception as exc:  # no JetStream on that account: nats' own errors
            raise MsglabError(f"the classroom server at {url.split('@')[-1]} answered, but not as expected: {exc!r}",
                              hint="check the details with your instructor") from exc  # fmt: skip
        limits = seen["limits"]
        told = (f"nats-server {seen['version']}, JetStream on; your account holds {seen['streams']} stream(s) "
                f"(limits: {limits.max_storage >> 20} MiB storage, {limits.max_streams} streams)")  # fmt: skip
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    saved: dict[str, str] = {"url": url, "joined": datetime.now().isoformat(timespec="seconds")}
    if ca:
        saved["ca"] = ca
        # The same certificate as a file: what NATS_CA (and the nats CLI's --tlsca) can name.
        (path.parent / CA_FILE).write_text(ca + "\n", encoding="ascii")
    else:
        (path.parent / CA_FILE).unlink(missing_ok=True)  # an earlier room's
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(saved, handle)
    user = urlsplit(url).username
    return "\n".join(
        line
        for line in (
            f"joined the classroom server at {url.split('@')[-1]} as {user}",
            f"  {told}" if told else "",
            f"  TLS: the server is checked against the room's certificate, kept in {path.parent / CA_FILE}"
            if ca
            else "",
            "  lessons and lab notebooks now use your account (NATS_URL, when set, still wins);",
            "  `msglab join --leave` undoes this",
        )
        if line
    )


def leave() -> str:
    path = state_file()
    if not path.exists():
        return "not joined to any classroom server"
    path.unlink()
    (path.parent / CA_FILE).unlink(missing_ok=True)
    return "left the classroom server: lessons use the built-in server again"
