"""The shop's email requests (lesson and lab 04), and what makes each one fail at the email provider.

One model for the lesson's bench (msglab.demos.poison_messages), the lab's grader and its
playground (msglab.graders.poison_messages). An email request is one order's email: the JSON the
worker parses and the headers the shop's producer puts on it. Its kind says what the provider
(msglab.world.email_provider) does with it:

    ok           sent at once
    flaky        the provider answers `script` first (503, 429, a reset connection), then sends it
    bounce       to a mailbox that does not exist: 422, every time
    template     its template is not deployed yet: 400 until an operator deploys it
    unreachable  to a domain whose mail server is down: 502 until the server is back
    malformed    its payload is cut off (not JSON): the worker's own code fails on it

`breaks(emails)` are the provider's control operations that make each email fail as its kind says,
`fixes(emails)` those that repair what an operator can fix (a template, a mail server, a mailbox);
both apply to a provider in a process of its own (`Provider.control`) or attached
(`Behaviour.control`). `forward` sends an email for a learner process and says what the provider
answered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from msglab.world import email_provider as ep

MISSING_MAILBOX = "anna@gmial.con"  # a mistyped address: the provider answers 422
DOWN_DOMAIN = "fjord.example"  # its mail server does not answer: 502 until it is back
NEW_TEMPLATE = "order_shipped_v2"  # not deployed yet: 400 until it is
Control = tuple[str, dict[str, Any]]  # one control operation of the provider: (op, arguments)


@dataclass(frozen=True)
class EmailRequest:
    """One order's email request, as the shop publishes it on orders.email."""

    order: str
    kind: str = "ok"
    to: str = ""
    template: str = "order_confirmation"
    correlation: str = ""  # the Correlation-Id header ("corr-<order>" unless given)
    script: tuple[str, ...] = ()  # flaky: the provider's first answers ("503", "429", "reset")

    @classmethod
    def make(cls, order: str, kind: str = "ok", name: str = "", **more: Any) -> Any:
        """An email of that kind to `name` (default: from the order): its address and template follow from the kind."""
        name = name or order.replace("-", "")
        to = {"bounce": MISSING_MAILBOX, "unreachable": f"{name}@{DOWN_DOMAIN}"}.get(kind, f"{name}@example.com")
        if kind == "template":
            more["template"] = NEW_TEMPLATE
        return cls(order, kind, to, **more)

    @property
    def headers(self) -> dict[str, str]:
        return {"Order-Id": self.order, "Correlation-Id": self.correlation or f"corr-{self.order}"}

    @property
    def payload(self) -> bytes:
        body = json.dumps({"order_id": self.order, "to": self.to, "template": self.template}).encode()
        return body[: len(body) // 2] if self.kind == "malformed" else body


def breaks(emails: list[Any] | tuple[Any, ...]) -> list[Control]:
    """The provider's control operations that make each email fail as its kind says."""
    found: list[Control] = []
    for email in emails:
        if email.kind == "bounce":
            found.append(("mailbox", {"address": email.to, "exists": False}))
        elif email.kind == "template":
            found.append(("template", {"name": email.template, "known": False}))
        elif email.kind == "unreachable":
            found.append(("domain", {"name": ep.domain_of(email.to), "reachable": False}))
        elif email.kind == "flaky":
            found.append(("script", {"address": email.to, "answers": list(email.script)}))
    return found


def fixes(emails: list[Any] | tuple[Any, ...]) -> list[Control]:
    """The operators' repairs of these emails' causes: the template deployed, the mail server back, the mailbox made."""
    found: list[Control] = []
    for email in emails:
        if email.kind == "template":
            found.append(("template", {"name": email.template, "known": True}))
        elif email.kind == "unreachable":
            found.append(("domain", {"name": ep.domain_of(email.to), "reachable": True}))
        elif email.kind == "bounce":
            found.append(("mailbox", {"address": email.to, "exists": True}))
    return found


@dataclass(frozen=True)
class Answer:
    """What the provider answered one send."""

    status: int  # 200 sent; else the error's HTTP status; 0 a reset connection
    text: str  # the message id, or what the provider said

    @property
    def error(self) -> str:
        """The exception a learner's env.send_email raises for it ('' when sent)."""
        return "" if self.status == 200 else "ConnectionResetError" if self.status == 0 else "EmailApiError"


FORWARD_TIMEOUT = 8.0  # seconds the grader waits for the provider on a learner's behalf


async def forward(nc: Any, subject: str, order: str, detail: dict[str, Any]) -> Answer:
    """Send one email for a learner process (its env.send_email call, `detail` its to and template).

    Raises only when the provider did not answer at all: the course's fault, never the learner's.
    """
    email = {"order_id": order, "to": detail.get("to"), "template": detail.get("template")}
    try:
        key = detail.get("idempotency_key")
        # A generous deadline (rule 8): with every core busy the provider's process answered after more than
        # the 2 s a lesson waits, and a provider that does not answer is the course's fault (exit 2).
        sent = await ep.send(nc, subject, email, idempotency_key=str(key) if key else None, timeout=FORWARD_TIMEOUT)
        return Answer(200, sent)
    except ep.EmailApiError as exc:
        return Answer(exc.status, str(exc))
    except ConnectionResetError as exc:
        return Answer(0, str(exc))
