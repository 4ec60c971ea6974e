"""The calibration's user-facing error: one line on the CLI, exit code 2."""
from paraplan.errors import ParaplanError


class CalibrationError(ParaplanError):
    """A calibration that cannot start (no GPU, one rank for --collectives, a bad option) or that
    failed part-way; in every case no profile file was written."""
