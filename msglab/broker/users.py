"""NATS users for a grading run's own server: the grader (and course services) may do anything,
the learner's processes only what a lab needs.

The learner user may publish and subscribe on ordinary subjects, publish to streams, fetch from
and ack on consumers, read stream and consumer info, and create consumers (nats-py gives even an
ephemeral consumer a name, so the create subject cannot tell them apart). It may not create,
update, delete or purge streams, delete consumers or messages, use the legacy durable-create
API, or touch the server's system subjects: so it cannot undo the platform's set-up or erase
evidence.
A lab adds denials of its own (subjects only a course service may publish on).
"""

from __future__ import annotations

import json
import secrets
from urllib.parse import quote, urlsplit, urlunsplit

LEARNER_DENY_PUBLISH = [
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.>",
    "$JS.API.STREAM.LEADER.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",  # the legacy durable API (nats-py names even ephemeral consumers)
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.UNPIN.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$SYS.>",
]
LEARNER_DENY_SUBSCRIBE = ["$SYS.>"]


class RunUsers:
    """The two users of one run's server, with fresh passwords."""

    def __init__(self, extra_deny_publish: list[str] | None = None) -> None:
        self.grader_password = secrets.token_urlsafe(18)
        self.learner_password = secrets.token_urlsafe(18)
        self.deny_publish = LEARNER_DENY_PUBLISH + list(extra_deny_publish or [])

    def config(self) -> str:
        """The server config text (JSON is valid NATS config syntax)."""
        users = [
            {"user": "grader", "password": self.grader_password},
            {
                "user": "learner",
                "password": self.learner_password,
                "permissions": {
                    "publish": {"deny": self.deny_publish},
                    "subscribe": {"deny": LEARNER_DENY_SUBSCRIBE},
                },
            },
        ]
        return "authorization " + json.dumps({"users": users}, indent=2) + "\n"

    def grader_url(self, url: str) -> str:
        return with_credentials(url, "grader", self.grader_password)

    def learner_url(self, url: str) -> str:
        return with_credentials(url, "learner", self.learner_password)


def with_credentials(url: str, user: str, password: str) -> str:
    """nats://host:port with user:password added."""
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# --- a shared server that msglab starts (`msglab server`, `make lab`) -----------------------------

ADMIN = "admin"
SLOTS = 32  # concurrent grading runs one grading machine can hold on a shared server


def slot_password(admin_password: str, slot: int) -> str:
    """A slot user's password, derived from the admin's: whoever holds the admin URL can grade."""
    import hashlib
    import hmac

    return hmac.new(admin_password.encode(), f"slot{slot:02d}".encode(), hashlib.sha256).hexdigest()[:32]


def slot_prefix(slot: int) -> str:
    """The subject prefix of a slot: its streams are S<NN>_*, its durables s<NN>_*, its subjects s<NN>.*."""
    return f"s{slot:02d}"


def _course_modules() -> list[object]:
    import importlib
    import pkgutil

    import msglab.demos
    import msglab.graders

    return [
        importlib.import_module(f"{package.__name__}.{info.name}")
        for package in (msglab.graders, msglab.demos)
        for info in pkgutil.iter_modules(package.__path__)
    ]


def course_streams() -> list[str]:
    """Every stream name a grader or lesson demo uses (their STREAM / STREAMS constants).

    Permissions match whole subject tokens, and a stream name is one token of the JetStream API
    subjects, so a slot's user is granted its streams by name: S07_ORDERS, not S07_*.
    """
    names: set[str] = set()
    for module in _course_modules():
        names.update(getattr(module, "STREAMS", ()))
        if isinstance(getattr(module, "STREAM", None), str):
            names.add(module.STREAM)  # type: ignore[attr-defined]
    return sorted(names)


def course_service_subjects() -> list[str]:
    """Subjects only course services may publish on (every grader's LEARNER_DENY_PUBLISH)."""
    subjects: set[str] = set()
    for module in _course_modules():
        subjects.update(getattr(module, "LEARNER_DENY_PUBLISH", ()))
    return sorted(subjects)


def slot_permissions(slot: int, streams: list[str], services: list[str] | None = None) -> dict[str, object]:
    """Only the slot's own subjects, streams, consumers and inbox; replies to requests it receives.

    `services` are subjects of course services inside the slot's names (e.g. its gateway's):
    denied, so a learner cannot speak for the service (deny wins over allow).
    """
    prefix = slot_prefix(slot)
    allow = [f"{prefix}.>", "$JS.API.INFO"]
    for name in streams:
        stream = f"{prefix.upper()}_{name}"
        allow += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.NAMES.{stream}",
            f"$JS.API.CONSUMER.LIST.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}",  # ephemeral consumers on its own streams
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
        ]
    deny = [f"{prefix}.{subject}" for subject in services or () if not subject.startswith("$")]
    return {
        "publish": {"allow": allow, "deny": deny},
        "subscribe": {"allow": [f"{prefix}.>", f"_INBOX_{prefix}.>"]},
        "allow_responses": True,
    }


class SharedUsers:
    """The users of a shared server: an admin (graders, lessons, course services) and one user per slot."""

    def __init__(self, admin_password: str | None = None, slots: int = SLOTS) -> None:
        self.admin_password = admin_password or secrets.token_urlsafe(18)
        self.slots = slots

    def config(self) -> str:
        users: list[dict[str, object]] = [{"user": ADMIN, "password": self.admin_password}]
        streams, services = course_streams(), course_service_subjects()
        for slot in range(1, self.slots + 1):
            users.append(
                {
                    "user": f"slot{slot:02d}",
                    "password": slot_password(self.admin_password, slot),
                    "permissions": slot_permissions(slot, streams, services),
                }
            )
        return "authorization " + json.dumps({"users": users}, indent=2) + "\n"

    def admin_url(self, url: str) -> str:
        return with_credentials(url, ADMIN, self.admin_password)


def admin_password_of(url: str) -> str | None:
    """The admin password in a URL of a server msglab started, or None for any other server."""
    parts = urlsplit(url.split(",")[0].strip())
    if parts.username == ADMIN and parts.password:
        from urllib.parse import unquote

        return unquote(parts.password)
    return None


def slot_url(url: str, slot: int) -> str:
    """The URL a learner process on `slot` gets, from the admin URL."""
    admin = admin_password_of(url)
    assert admin is not None
    return with_credentials(url, f"slot{slot:02d}", slot_password(admin, slot))


def start_shared_server(**options: object) -> tuple[object, str]:
    """Start an EmbeddedServer with the shared users; return it and the admin URL (NATS_URL for the course)."""
    import os
    import tempfile

    from msglab.broker.server import EmbeddedServer

    users = SharedUsers()
    fd, config = tempfile.mkstemp(prefix="msglab-shared-", suffix=".conf")
    try:
        os.write(fd, users.config().encode())
        os.close(fd)
        server = EmbeddedServer(config=config, **options).start()  # type: ignore[arg-type]
    finally:
        os.unlink(config)  # read at start; the passwords need not stay on disk
    return server, users.admin_url(server.url)
