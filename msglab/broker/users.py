"""NATS users for a grading run's own server: the grader (and course services) may do anything,
the learner's processes only what a lab needs.

The learner user may publish to the lab's streams, fetch from and ack on consumers, read stream and
consumer info, and create consumers of its own (nats-py names even an ephemeral consumer, so a
named create is allowed for every name but the platform's durables). It may not create, update,
delete or purge streams, delete consumers or messages, create or update the platform's durables
(`$JS.API.CONSUMER.CREATE` is create-or-update, and so is its unnamed legacy form when the config
carries a name: both are denied where they could reach a platform durable), list consumers (the
grader's own have unguessable names), use the legacy durable-create API, speak for a course
service (the email provider's, the gateway's subjects), read anyone else's inbox (it has its own
prefix, `LEARNER_INBOX`), or touch the server's system subjects. Its account's JetStream storage
is bounded (`RUN_JETSTREAM`): a run cannot fill the grader's disk or memory.

What a lab needs comes from its grader module, read with defaults so graders can add them:
  STREAM, STREAMS       the streams it creates (STREAM holds the platform's durables)
  DURABLE, DURABLES     the platform's durables, which learner code may only read, fetch from and ack
  LEARNER_SUBJECTS      the ordinary subjects learner code may publish and subscribe on (wildcards
                        allowed); without it, every subject but the denied ones, as before
  LEARNER_REQUESTS      subjects of the lab's services it may send requests to, never listen on
                        (so it cannot answer for them); only with LEARNER_SUBJECTS
  LEARNER_DENY_PUBLISH  subjects only the grader or a course service may publish on
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

LEARNER = "learner"
LEARNER_INBOX = "_INBOX_learner"  # the learner's inbox prefix on a run's own server (MSGLAB_INBOX)
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
    "$JS.API.CONSUMER.NAMES.>",  # the grader's own consumers are safe while their names are unknown
    "$JS.API.CONSUMER.LIST.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$SYS.>",
]
LEARNER_DENY_SUBSCRIBE = ["$SYS.>", "_INBOX.>"]  # `_INBOX.` is the grader's and the services' inbox
# The course services' subjects under their default prefixes (msglab.world): learner code may not
# listen to them (the grader's requests and their answers are evidence). It may not speak for the
# ones only the grader asks (it forwards what a lab's effects need); a lesson's workers ask the
# gateway themselves, so a lab that forbids that says so in its LEARNER_DENY_PUBLISH.
COURSE_SERVICES = ["provider.>", "gateway.>"]
GRADER_ONLY_SERVICES = ["provider.>"]
# A run's own server: its account's JetStream storage (a lab stores kilobytes; an attack stored 300 MB).
RUN_JETSTREAM = {"max_memory": 32 << 20, "max_file": 64 << 20, "max_streams": 16, "max_consumers": 64}
# A shared server's slot: each slot is an account of its own with this bound. The server reserves every
# account's bound at start, so it is smaller than a run's own (32 slots reserve 256 MB of memory, 1 GB of disk).
SLOT_JETSTREAM = {"max_memory": 8 << 20, "max_file": 32 << 20, "max_streams": 16, "max_consumers": 64}


def _names(module: Any, one: str, many: str) -> list[str]:
    """A grader's ONE (a string) and MANY (a sequence) constants, e.g. STREAM and STREAMS."""
    found = [module.__dict__[one]] if isinstance(getattr(module, one, None), str) else []
    return found + [name for name in getattr(module, many, ()) if name not in found]


def platform_consumer_denials(stream_prefix: str, streams: Iterable[str], durables: Iterable[str]) -> list[str]:
    """Subjects that could create or update a platform durable: named creates of its name, the unnamed
    legacy create on streams holding one (verified: a config naming the durable updates it)."""
    denied = [f"$JS.API.CONSUMER.CREATE.{stream_prefix}{stream}" for stream in streams]
    for durable in durables:
        denied += [f"$JS.API.CONSUMER.CREATE.*.{durable}", f"$JS.API.CONSUMER.CREATE.*.{durable}.>"]
    return denied


def jetstream_allow(stream_names: Iterable[str]) -> list[str]:
    """The JetStream API a learner needs on these streams: info, reading, its own consumers, fetch and ack."""
    allow = ["$JS.API.INFO"]
    for stream in stream_names:
        allow += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.CREATE.{stream}",  # unnamed (legacy); denied where a platform durable lives
            f"$JS.API.CONSUMER.CREATE.{stream}.*",  # named, e.g. nats-py's ephemerals; platform names denied
            f"$JS.API.CONSUMER.CREATE.{stream}.*.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",  # flow control replies of a push consumer
        ]
    return allow


class RunUsers:
    """The two users of one run's server, with fresh passwords, in an account with bounded JetStream."""

    def __init__(self, extra_deny_publish: list[str] | None = None, *, grader: Any = None) -> None:
        self.grader_password = secrets.token_urlsafe(18)
        self.learner_password = secrets.token_urlsafe(18)
        self.inbox_prefix = LEARNER_INBOX
        extra = list(extra_deny_publish or []) + list(getattr(grader, "LEARNER_DENY_PUBLISH", []) or [])
        if grader is not None:
            streams, durables = _names(grader, "STREAM", "STREAMS"), _names(grader, "DURABLE", "DURABLES")
            platform = [grader.STREAM] if isinstance(getattr(grader, "STREAM", None), str) else streams[:1]
        else:  # the course's every stream and durable: strict without knowing the lab
            streams, durables, platform = course_streams(), course_durables(), course_platform_streams()
        self.streams = streams
        self.subjects: list[str] | None = list(getattr(grader, "LEARNER_SUBJECTS", None) or []) or None
        self.requests = list(getattr(grader, "LEARNER_REQUESTS", None) or [])
        self.deny_publish = (
            LEARNER_DENY_PUBLISH + GRADER_ONLY_SERVICES + platform_consumer_denials("", platform, durables) + extra
        )
        self.deny_subscribe = LEARNER_DENY_SUBSCRIBE + COURSE_SERVICES

    def learner_permissions(self) -> dict[str, object]:
        """Publish and subscribe rules of the learner user (deny wins over allow)."""
        if self.subjects is None:  # no declared subjects: everything ordinary, minus the denials
            return {
                "publish": {"deny": self.deny_publish},
                "subscribe": {"deny": self.deny_subscribe},
            }
        return {
            # STREAM.NAMES: nats-py's pull_subscribe finds a stream by subject when none is named
            "publish": {
                "allow": [*self.subjects, *self.requests, "$JS.API.STREAM.NAMES", *jetstream_allow(self.streams)],
                "deny": self.deny_publish,
            },
            "subscribe": {
                "allow": [*self.subjects, f"{self.inbox_prefix}.>"],
                "deny": self.deny_subscribe + self.requests,
            },
            "allow_responses": True,  # answer the grader's requests to a service it runs
        }

    def config(self) -> str:
        """The server config text (JSON is valid NATS config syntax)."""
        users = [
            {"user": "grader", "password": self.grader_password},
            {"user": LEARNER, "password": self.learner_password, "permissions": self.learner_permissions()},
        ]
        accounts = {"RUN": {"jetstream": RUN_JETSTREAM, "users": users}}
        return "accounts " + json.dumps(accounts, indent=2) + "\n"

    def grader_url(self, url: str) -> str:
        return with_credentials(url, "grader", self.grader_password)

    def learner_url(self, url: str) -> str:
        return with_credentials(url, LEARNER, self.learner_password)


def with_credentials(url: str, user: str, password: str) -> str:
    """nats://host:port with user:password added."""
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# --- a shared server that msglab starts (`msglab server`, `make lab`) -----------------------------

ADMIN = "admin"
SLOTS = 32  # concurrent grading runs one grading machine can hold on a shared server


def _derived(admin_password: str, user: str) -> str:
    import hashlib
    import hmac

    return hmac.new(admin_password.encode(), user.encode(), hashlib.sha256).hexdigest()[:32]


def slot_password(admin_password: str, slot: int) -> str:
    """A slot user's password, derived from the admin's: whoever holds the admin URL can grade."""
    return _derived(admin_password, f"slot{slot:02d}")


def slot_grader_password(admin_password: str, slot: int) -> str:
    """The password of a slot's grader user (its account's full rights), derived from the admin's."""
    return _derived(admin_password, f"slot{slot:02d}-grader")


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
        names.update(_names(module, "STREAM", "STREAMS"))
    return sorted(names)


def course_durables() -> list[str]:
    """Every platform durable a grader or lesson demo names (their DURABLE / DURABLES constants)."""
    names: set[str] = set()
    for module in _course_modules():
        names.update(_names(module, "DURABLE", "DURABLES"))
    return sorted(names)


def course_platform_streams() -> list[str]:
    """The streams that hold a platform durable: each grader's STREAM when it names a durable."""
    names: set[str] = set()
    for module in _course_modules():
        if _names(module, "DURABLE", "DURABLES") and isinstance(getattr(module, "STREAM", None), str):
            names.add(module.STREAM)  # type: ignore[attr-defined]
    return sorted(names)


def course_service_subjects() -> list[str]:
    """Subjects only course services may publish on (every grader's LEARNER_DENY_PUBLISH, the services')."""
    subjects: set[str] = set(GRADER_ONLY_SERVICES)
    for module in _course_modules():
        subjects.update(getattr(module, "LEARNER_DENY_PUBLISH", ()))
    return sorted(subjects)


def slot_permissions(
    slot: int,
    streams: list[str],
    services: list[str] | None = None,
    durables: list[str] | None = None,
    platform_streams: list[str] | None = None,
) -> dict[str, object]:
    """Only the slot's own subjects, streams, consumers and inbox; replies to requests it receives.

    `services` are subjects of course services inside the slot's names (e.g. its gateway's):
    denied, so a learner cannot speak for the service (deny wins over allow); `durables` are the
    platform's, which the slot may read, fetch from and ack but never create or update, on
    `platform_streams` (by default every stream).
    """
    prefix = slot_prefix(slot)
    stream_prefix = f"{prefix.upper()}_"
    allow = [f"{prefix}.>", *jetstream_allow(stream_prefix + name for name in streams)]
    services_denied = [f"{prefix}.{subject}" for subject in services or () if not subject.startswith("$")]
    deny = list(services_denied)
    deny += [subject for subject in LEARNER_DENY_PUBLISH if subject.startswith("$JS.API.CONSUMER.")]
    deny += platform_consumer_denials(
        stream_prefix,
        streams if platform_streams is None else platform_streams,
        [f"{prefix}_{durable}" for durable in durables or ()],
    )
    return {
        "publish": {"allow": allow, "deny": deny},
        "subscribe": {"allow": [f"{prefix}.>", f"_INBOX_{prefix}.>"], "deny": services_denied},
        "allow_responses": True,
    }


class SharedUsers:
    """The users of a shared server: an admin (lessons, course services) and one account per grading slot.

    A slot's account holds its grader user (full rights there: the run's streams, durables, services and
    broker watch) and its learner user (`slot_permissions`), and bounds its JetStream (`SLOT_JETSTREAM`):
    a run can neither fill the server's storage for everyone nor see another account's subjects.
    """

    def __init__(self, admin_password: str | None = None, slots: int = SLOTS) -> None:
        self.admin_password = admin_password or secrets.token_urlsafe(18)
        self.slots = slots

    def config(self) -> str:
        streams, services, durables = course_streams(), course_service_subjects(), course_durables()
        platform = course_platform_streams()
        accounts: dict[str, object] = {
            "COURSE": {"jetstream": "enabled", "users": [{"user": ADMIN, "password": self.admin_password}]}
        }
        for slot in range(1, self.slots + 1):
            grader = {"user": f"slot{slot:02d}-grader", "password": slot_grader_password(self.admin_password, slot)}
            learner = {
                "user": f"slot{slot:02d}",
                "password": slot_password(self.admin_password, slot),
                "permissions": slot_permissions(slot, streams, services, durables, platform),
            }
            accounts[f"SLOT{slot:02d}"] = {"jetstream": SLOT_JETSTREAM, "users": [grader, learner]}
        return _store_limits(self.slots) + "accounts " + json.dumps(accounts, indent=2) + "\n"

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


def slot_grader_url(url: str, slot: int) -> str:
    """The URL of the grader (and its course services) of a run on `slot`, from the admin URL."""
    admin = admin_password_of(url)
    assert admin is not None
    return with_credentials(url, f"slot{slot:02d}-grader", slot_grader_password(admin, slot))


RESERVE_HEADROOM = 256 << 20  # what the course's own account keeps beyond the slots' reservation


def _store_limits(slots: int) -> str:
    """Server-wide JetStream maxima, only where the machine's defaults (75% of its memory and of the free
    disk) could not hold every slot's reserved bound: the server would refuse to start otherwise."""
    import os
    import shutil
    import tempfile

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
    disk = shutil.disk_usage(tempfile.gettempdir()).free * 3 // 4
    need_memory = slots * SLOT_JETSTREAM["max_memory"] + RESERVE_HEADROOM
    need_disk = slots * SLOT_JETSTREAM["max_file"] + RESERVE_HEADROOM
    limits = {}
    if memory < need_memory:
        limits["max_memory_store"] = need_memory
    if disk < need_disk:
        limits["max_file_store"] = need_disk
    return "jetstream " + json.dumps(limits) + "\n" if limits else ""


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
