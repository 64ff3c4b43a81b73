"""What learner code is handed when a grader (or a lesson) runs it: the `env` argument.

`env.nc` and `env.js` are a live connection and its JetStream context; `env.subject()`,
`env.stream()` and `env.durable()` give the names to use (plain names on the grader's own
server, prefixed ones when sharing a server named by NATS_URL, so runs never collide); effects
such as `env.send_email` are added by each lab's grader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Names:
    """Maps the course's names to isolated ones when a server is shared."""

    prefix: str = ""

    def subject(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def stream(self, name: str) -> str:
        return f"{self.prefix.upper()}_{name}" if self.prefix else name

    def durable(self, name: str) -> str:
        return f"{self.prefix}_{name}" if self.prefix else name


class LabEnv:
    """The learner's handle on the world; graders add lab-specific effects as attributes."""

    def __init__(self, nc: Any, js: Any, names: Names, params: dict[str, Any] | None = None) -> None:
        self.nc = nc
        self.js = js
        self.names = names
        self.params = dict(params or {})
        for key, value in self.params.items():
            setattr(self, key, value)

    def subject(self, name: str) -> str:
        """The subject to use for `name` (e.g. 'orders.placed') in this run."""
        return self.names.subject(name)

    def stream(self, name: str) -> str:
        """The stream to use for `name` (e.g. 'ORDERS') in this run."""
        return self.names.stream(name)

    def durable(self, name: str) -> str:
        """The durable consumer name to use for `name` (e.g. 'email') in this run."""
        return self.names.durable(name)


async def provision(
    js: Any, names: Names, *, stream: str, wildcard: str, durable: str, subject: str, ack_wait: float, **consumer: Any
) -> None:
    """The platform team's part of a lab: a stream and a durable on it, made before any learner code runs.

    `wildcard` (e.g. 'orders.>') is what the stream stores, `subject` what the durable delivers;
    extra keyword arguments go to the ConsumerConfig (e.g. max_ack_pending).
    """
    from nats.js.api import AckPolicy, ConsumerConfig

    await js.add_stream(name=names.stream(stream), subjects=[names.subject(wildcard)])
    config = ConsumerConfig(
        durable_name=names.durable(durable),
        filter_subject=names.subject(subject),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        **consumer,
    )
    await js.add_consumer(names.stream(stream), config)
