"""`msglab classroom serve`: one nats-server for a room, one NATS account per learner.

The generated config (JSON, which nats-server reads as its own config syntax):

    system_account: SYS
    accounts {
      SYS:   { users: [ {user: instructor, password: ...} ] }          # monitoring, `classroom status`
      alice: { jetstream: {max_mem, max_file, max_streams, max_consumers},
               limits: {max_connections},                          # a learner's code cannot flood the room
               users: [ {user: alice, password: ...} ] }               # one per learner
    }
    jetstream { max_mem, max_file }     # the learners' limits added up: every account's limits fit
    http: "127.0.0.1:8222"              # monitoring, on this machine only unless --monitor-host

What that guarantees (checked against the real server by tests/test_classroom.py): an account is
a namespace of its own, so a learner's streams, consumers, subjects and reply inboxes are
invisible to every other learner, and a lesson's fixed names (ORDERS, orders.placed) collide
with nobody's; the config has no exports or imports between learner accounts. JetStream limits
are per account (`max_consumers` per stream, as nats-server applies it): a learner over their
storage gets "resource limits exceeded for account" on publish, and nobody else notices; a learner
over `max_connections` gets "maximum account active connections exceeded" when connecting, and
nobody else notices either.

The address handed out is one learners' laptops can reach: `--advertise` (an address of this
machine on the room's network: `serve` lists them when it is missing), never a loopback address or
a name that does not resolve, unless `--local` (a room on this one machine).

With `tls` (`serve --tls`) every client connection must be TLS (the config's `tls {}` block,
no `allow_non_tls`): nats-server announces `tls_required` before any credentials are sent, nats-py
then upgrades the connection first, and a client that sends its CONNECT in clear is cut off. The
room makes its own CA (tls/ca.pem, kept across restarts so handouts stay valid; its key 0600) and,
at every start, a server certificate for the advertised address and this machine's loopback (the
instructor's tools). Handouts carry `tls://` URLs and the CA's certificate, so `msglab join
learners/<name>.txt` is one step. Certificates are made with the `cryptography` package, an
optional extra (`pip install 'msglab[classroom]'`) only the instructor's machine needs: learners'
machines check them with Python's own ssl module.

The folder (default ./classroom, mode 0700) keeps everything: classroom.json (passwords, limits,
where the server listens), server.conf, learners/<name>.txt and handout.csv (what to hand out),
store/ (the streams, kept across restarts), tls/ with --tls. Serving the same folder again keeps
every learner's password, so details handed out stay valid.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from msglab.broker import ROOM_CA_NAME
from msglab.broker.users import with_credentials
from msglab.errors import MsglabError

MIB = 1 << 20
SYSTEM = "SYS"
INSTRUCTOR = "instructor"
NAME_RULE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
RESERVED = {SYSTEM.lower(), INSTRUCTOR, "admin", "$g", "$sys", "grader", "learner"}
STATE = "classroom.json"


class ClassroomError(MsglabError):
    """The classroom server cannot be set up as asked."""


@dataclass(frozen=True)
class Limits:
    """JetStream limits of each learner's account."""

    max_mem: int = 64 * MIB  # bytes of memory-storage streams
    max_file: int = 512 * MIB  # bytes of file-storage streams
    max_streams: int = 32
    max_consumers: int = 64  # per stream: nats-server applies the account's max_consumers to each stream
    # A lesson's kernel, `msglab check` (the grader, 3-4 learner processes, the course's services) and a
    # lab notebook at once stay well under 32; a loop opening connections does not.
    max_connections: int = 32

    def describe(self) -> str:
        return (f"{self.max_mem // MIB} MiB memory, {self.max_file // MIB} MiB file storage, "
                f"{self.max_streams} streams, {self.max_consumers} consumers per stream, "
                f"{self.max_connections} connections")  # fmt: skip

    def jetstream(self) -> dict[str, int]:
        return {"max_mem": self.max_mem, "max_file": self.max_file, "max_streams": self.max_streams,
                "max_consumers": self.max_consumers}  # fmt: skip


def learner_names(spec: str) -> list[str]:
    """`30` (learner01..learner30), `alice,bob`, or a file with one name a line."""
    spec = spec.strip()
    if spec.isdigit():
        count = int(spec)
        if not 1 <= count <= 500:
            raise ClassroomError(f"--learners {count}: a classroom has 1 to 500 learners")
        return [f"learner{i:02d}" for i in range(1, count + 1)]
    path = Path(spec.removeprefix("@"))
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        names = [line.split("#", 1)[0].strip() for line in lines]
    else:
        names = [name.strip() for name in spec.split(",")]
    names = [name for name in names if name]
    bad = [name for name in names if not NAME_RULE.match(name) or name.lower() in RESERVED]
    if bad:
        raise ClassroomError(
            f"learner names must start with a letter and hold only letters, digits, _ and - "
            f"(and not be {', '.join(sorted(RESERVED))}): {', '.join(bad[:5])}",
            hint="use ids such as alice, bob_k or s-1042",
        )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ClassroomError(f"learner names appear twice: {', '.join(duplicates)}")
    if not names:
        raise ClassroomError("no learner names given", hint="--learners 30, or --learners alice,bob")
    return names


def room_address() -> str:
    """This machine's first non-loopback address (no packet is sent to find it), or 127.0.0.1."""
    found = machine_addresses()
    return found[0] if found else "127.0.0.1"


def machine_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses: the ones a room's laptops may reach it at."""
    found: list[str] = []
    try:  # Linux: every interface's address (iproute2)
        done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5)
        found += [m.group(1) for m in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+)/", done.stdout)]
    except (OSError, subprocess.SubprocessError):
        pass
    with contextlib.suppress(OSError):  # elsewhere: what this machine's name resolves to
        found += [str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return list(dict.fromkeys(ip for ip in found if not ipaddress.ip_address(ip).is_loopback))


def advertised(advertise: str, *, local: bool = False) -> str:
    """The address handed out to learners, checked: reachable from their laptops, or `local` (this machine only)."""
    if local and not advertise:
        return "127.0.0.1"
    listed = ", ".join(machine_addresses()) or "none found"
    if not advertise:
        raise ClassroomError(
            f"say which address learners' laptops reach this machine at: --advertise ADDRESS "
            f"(this machine's addresses: {listed})",
            hint="or --local for a room on this machine only",
        )
    try:
        resolved = {str(a[4][0]) for a in socket.getaddrinfo(advertise.strip("[]"), None)}
    except OSError as exc:
        raise ClassroomError(f"--advertise {advertise}: the name does not resolve ({exc.strerror or exc})",
                             hint=f"give an address instead (this machine's: {listed})") from exc  # fmt: skip
    if not local and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in resolved):
        raise ClassroomError(
            f"--advertise {advertise} is this machine's loopback ({', '.join(sorted(resolved))}): a learner's "
            "laptop would connect to itself",
            hint=f"advertise an address of this machine on the room's network ({listed}), or --local",
        )
    return advertise


@dataclass
class Classroom:
    """One room: its learners and their passwords, limits, and where the server listens."""

    folder: Path
    learners: dict[str, str]  # name -> password
    instructor_password: str
    limits: Limits = field(default_factory=Limits)
    host: str = "0.0.0.0"
    port: int = 4222  # 0: any free port
    advertise: str = ""  # the address learners use; default: this machine's room address
    monitor_host: str = "127.0.0.1"
    monitor_port: int = 8222  # 0: any free port
    bound_port: int = 0  # the port the running server listens on (set once started)
    bound_monitor_port: int = 0
    tls: bool = False  # every client connection TLS, checked against the room's own CA

    # --- the folder ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: Path) -> Classroom:
        path = folder / STATE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ClassroomError(f"{path} does not exist: no classroom was served from {folder}",
                                 hint="start one with `msglab classroom serve --learners 30`") from exc  # fmt: skip
        except (OSError, ValueError) as exc:
            raise ClassroomError(f"{path} cannot be read: {exc}") from exc
        data["folder"] = folder
        data["limits"] = Limits(**data.get("limits", {}))
        return cls(**data)

    @classmethod
    def create(cls, folder: Path, names: list[str], **options: Any) -> Classroom:
        """A new classroom, or the one already in `folder` with these learners (old passwords kept)."""
        passwords: dict[str, str] = {}
        instructor = secrets.token_urlsafe(18)
        if (folder / STATE).is_file():
            old = cls.load(folder)
            passwords, instructor = dict(old.learners), old.instructor_password
        learners = {name: passwords.get(name) or secrets.token_urlsafe(12) for name in names}
        return cls(folder, learners, instructor, **options)

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)  # passwords live here
        data = asdict(self)
        data.pop("folder")
        _write_private(self.folder / STATE, json.dumps(data, indent=2) + "\n")
        _write_private(self.folder / "server.conf", json.dumps(self.config(), indent=2) + "\n")

    # --- the server's config ------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        connections = self.limits.max_connections
        accounts: dict[str, Any] = {SYSTEM: {"users": [{"user": INSTRUCTOR, "password": self.instructor_password}]}}
        for name, password in self.learners.items():
            accounts[name] = {"jetstream": self.limits.jetstream(), "limits": {"max_connections": connections},
                              "users": [{"user": name, "password": password}]}  # fmt: skip
        count = len(self.learners)
        return {
            "server_name": "msglab-classroom",
            "system_account": SYSTEM,
            "accounts": accounts,
            # Room for every account's limits at once (nats-server refuses limits it could not honour).
            "jetstream": {"max_mem": count * self.limits.max_mem, "max_file": count * self.limits.max_file},
            "http": f"{self.monitor_host}:{self.monitor_port or -1}",
        } | ({"tls": self.tls_block()} if self.tls else {})

    # --- TLS ----------------------------------------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        """The room's CA certificate (public: handed out to every learner)."""
        return self.folder / "tls" / "ca.pem"

    def ca_pem(self) -> str:
        return self.ca_file.read_text(encoding="ascii")

    def tls_block(self) -> dict[str, Any]:
        folder = self.folder / "tls"
        # No allow_non_tls: TLS is required of every client. handshake_first: a client may start with
        # the TLS handshake (the course's do, msglab.broker.tls_options), others get INFO after 1 s: at
        # 300 ms a course client on a loaded machine was still starting its handshake when INFO came; at
        # 2 s a client waiting for INFO hit its own 2 s connect timeout (msglab.broker.connect).
        # timeout: a handshake on a busy laptop can take longer than nats-server's default.
        return {"cert_file": str(folder / "server.pem"), "key_file": str(folder / "server-key.pem"),
                "handshake_first": "1s", "timeout": 5}  # fmt: skip

    def tls_names(self) -> list[str]:
        """The names the server certificate holds: the advertised address and this machine's loopback."""
        return list(dict.fromkeys([self.public_host, "127.0.0.1", "localhost"]))

    def tls_options(self) -> dict[str, Any]:
        """nats.connect options that check this room's server against its CA ({} without TLS)."""
        from msglab.broker import tls_options

        return tls_options(self.local_url(INSTRUCTOR), self.ca_pem()) if self.tls else {}

    # --- addresses ----------------------------------------------------------------------------------

    @property
    def public_host(self) -> str:
        if self.advertise:
            return self.advertise
        return room_address() if self.host in ("0.0.0.0", "::", "") else self.host

    def _port(self) -> int:
        return self.bound_port or self.port

    @property
    def scheme(self) -> str:
        return "tls" if self.tls else "nats"

    def learner_url(self, name: str) -> str:
        """What learner `name` gets: a URL with their credentials, at the address the room uses."""
        url = f"{self.scheme}://{_bracket(self.public_host)}:{self._port()}"
        return with_credentials(url, name, self.learners[name])

    def local_url(self, user: str) -> str:
        """A URL for `user` from this machine (the instructor's tools)."""
        password = self.instructor_password if user == INSTRUCTOR else self.learners[user]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return with_credentials(f"{self.scheme}://{_bracket(host)}:{self._port()}", user, password)

    @property
    def monitor_url(self) -> str:
        return f"http://{_bracket(self.monitor_host)}:{self.bound_monitor_port or self.monitor_port}"

    def write_handouts(self) -> Path:
        """learners/<name>.txt (one per learner) and handout.csv (all of them); return the csv's path."""
        folder = self.folder / "learners"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(mode=0o700)
        rows = ["learner,url,command"]
        for name in self.learners:
            url = self.learner_url(name)
            if self.tls:
                # The CA travels inside the handout: `msglab join <this file>` takes both in one step.
                text = (
                    f"msglab classroom account: {name}\n\n"
                    f"Save this file in the course folder and run:\n\n    msglab join {name}.txt\n\n"
                    "The room's server speaks TLS only: the file holds your URL and the room's certificate\n"
                    "(below), which `msglab join` keeps, so your password only ever travels encrypted to the\n"
                    "room's own server. In a shell instead: NATS_URL=<the URL> and NATS_CA=<this file>.\n\n"
                    f"URL: {url}\n\n{self.ca_pem()}"
                )
                command = f"msglab join {name}.txt"
            else:
                text = (
                    f"msglab classroom account: {name}\n\n"
                    f"In the course folder, run:\n\n    msglab join {url}\n\n"
                    f"(or set NATS_URL={url} in the shell that runs the course)\n"
                )
                command = f"msglab join {url}"
            text += (
                "Lessons and lab notebooks then work on your own account of the room's server. `msglab check`\n"
                "still grades on a fresh server of its own on your machine; to grade on the room's server, set\n"
                f"NATS_URL=<your URL>{' and NATS_CA=<this file>' if self.tls else ''} in the shell that runs it.\n"
            )
            _write_private(folder / f"{name}.txt", text)
            rows.append(f"{name},{url},{command}")
        _write_private(self.folder / "handout.csv", "\n".join(rows) + "\n")
        return self.folder / "handout.csv"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    path.chmod(0o600)


def make_certificates(folder: Path, names: list[str]) -> None:
    """The room's CA in `folder` (made once, kept while valid for 30 more days) and a server certificate for `names`.

    ECDSA P-256 throughout (quick to make, read by Go's TLS and Python's ssl); the keys are 0600.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise ClassroomError(
            "--tls makes the room's certificates with the cryptography package, which is not installed",
            hint="pip install 'msglab[classroom]' on this machine (learners need nothing more)",
        ) from exc

    now = datetime.now(UTC)
    folder.mkdir(mode=0o700, exist_ok=True)
    ca_file, ca_key_file = folder / "ca.pem", folder / "ca-key.pem"
    ca_cert: Any = None
    ca_key: Any = None
    with contextlib.suppress(OSError, ValueError):
        kept = x509.load_pem_x509_certificate(ca_file.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
        if kept.not_valid_after_utc >= now + timedelta(days=30):
            ca_cert = kept
    if ca_cert is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{ROOM_CA_NAME} {secrets.token_hex(4)}")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=730))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        _write_private(ca_key_file, _key_pem(ca_key, serialization))
        ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        ca_file.chmod(0o644)  # public: it goes into every handout
    sans: list[x509.GeneralName] = []
    for host in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]").split("%")[0])))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "msglab classroom server")]))  # SANs name it
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(min(now + timedelta(days=365), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    _write_private(folder / "server-key.pem", _key_pem(key, serialization))
    _write_private(folder / "server.pem", cert.public_bytes(serialization.Encoding.PEM).decode("ascii"))


def _key_pem(key: Any, serialization: Any) -> str:
    return str(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()).decode("ascii"))  # fmt: skip


def start(classroom: Classroom) -> Any:
    """Start the room's nats-server (an EmbeddedServer); the classroom learns its ports. Stop it with .stop()."""
    from msglab.broker.server import EmbeddedServer

    classroom.save()
    if classroom.tls:  # the server certificate names the address of this start
        make_certificates(classroom.folder / "tls", classroom.tls_names())
    store = classroom.folder / "store"
    store.mkdir(mode=0o700, exist_ok=True)
    total = classroom.limits.max_file * len(classroom.learners)
    free = shutil.disk_usage(store).free
    if total > free:
        print(f"msglab: warning: the learners' storage limits add up to {total // MIB} MiB, "
              f"{store} has {free // MIB} MiB free", flush=True)  # fmt: skip
    # Flags given last win over the EmbeddedServer's own (-a, -p, -sd): the room's host, port and store.
    args = ["-a", classroom.host, "-p", str(classroom.port or -1), "-sd", str(store)]
    server = EmbeddedServer(config=str(classroom.folder / "server.conf"), extra_args=args, name="msglab-classroom")
    server.start()
    classroom.bound_port = int(server.port or 0)
    classroom.bound_monitor_port = int(server.monitor_port or 0)
    classroom.save()
    classroom.write_handouts()
    return server


def joined_account(url: str) -> str:
    """The user name in a URL (the learner's account name on a classroom server)."""
    return urlsplit(url.split(",")[0].strip()).username or ""
