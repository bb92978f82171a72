"""zerorun: a launcher and ZeRO runtime for data-parallel PyTorch training (Rajbhandari et al., arXiv:1910.02054)."""

__version__ = "0.1.0"

from zerorun.telemetry.report import report  # noqa: E402,F401 - the telemetry call for users' own scripts
