"""One error root for everything a user can get wrong; the CLI prints it on one line and exits 2."""


def first_line(exc: BaseException) -> str:
    """An exception's message, first line only (errors are one line), or '' when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class ParaplanError(Exception):
    """Base class of every user-facing error (bad input, infeasible request)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a batch scheduler, CI) unwinds like Ctrl-C: a launched job is stopped,
    half-written files are removed. The CLI exits 143 (128 + SIGTERM) with `error: terminated`."""


class ConfigError(ParaplanError):
    """A scenario, profile or override is malformed: names the key path and what is allowed."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        """What is wrong, without the key path (to re-raise it under another path or with context)."""
        super().__init__(f"{path}: {message}" if path else message)


class InfeasiblePlanError(ParaplanError):
    """A plan that cannot run: degrees that do not divide, or it does not fit in memory."""

    def __init__(self, reasons):
        self.reasons = tuple(reasons)
        super().__init__("infeasible plan: " + "; ".join(self.reasons))
