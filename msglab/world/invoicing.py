"""The invoicing service of lesson 02's lab: its errors, what it says, and when it refuses.

One model for the lab's grader (msglab.graders.delivery_guarantees, which answers the service's
calls for the learner's processes) and its playground (the lab notebook). A request belongs to
one of three customers' situations: `normal` (invoiced at once), `transient` (the service is
restarting: ServiceUnavailable until its outage is over and it failed at least `min_tries`
tries), or `refused` (the account is closed: AccountClosed, every time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


# Learners see these (help(env.AccountClosed)): their docstrings say what happened, never whether
# a retry helps: that judgement is the lab's decision.
class InvoicingError(Exception):
    """The invoicing service did not issue the invoice."""


class ServiceUnavailable(InvoicingError):
    """The invoicing service answered that it is unavailable."""


class AccountClosed(InvoicingError):
    """The invoicing service answered that the customer's account is closed."""


ERRORS = (InvoicingError, ServiceUnavailable, AccountClosed)


def unavailable_text(key: str) -> str:
    return f"the invoicing service is restarting (deploy in progress); invoice for {key} not issued, try again shortly"


def closed_text(key: str, customer: str) -> str:
    return f"customer {customer} has closed their account; no invoice can be issued for order {key}"


@dataclass
class Invoicing:
    """The service's decisions: `attempt` returns "sent" or raises the error the service answers."""

    min_tries: int = 0  # a transient request fails at least this many tries, however long it waits
    first_try: dict[str, float] = field(default_factory=dict)
    tries: dict[str, int] = field(default_factory=dict)

    def attempt(self, key: str, kind: str, customer: str = "", outage: float = 0.0, now: float | None = None) -> str:
        """One try at invoicing `key` (`kind`: normal, transient, refused, as the module says)."""
        now = time.monotonic() if now is None else now
        if kind == "refused":
            raise AccountClosed(closed_text(key, customer))
        if kind == "transient":
            start = self.first_try.setdefault(key, now)
            self.tries[key] = tries = self.tries.get(key, 0) + 1
            if now < start + outage or tries <= self.min_tries:
                raise ServiceUnavailable(unavailable_text(key))
        return "sent"
