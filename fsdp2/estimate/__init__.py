"""``python -m fsdp2.estimate``: how much memory one rank of a large job needs, measured on this CPU (see ``session``)."""

from .cli import estimate, format_report, main, parse_command
from .fake import fake_distributed
from .session import Session

__all__ = ["Session", "estimate", "fake_distributed", "format_report", "main", "parse_command"]
