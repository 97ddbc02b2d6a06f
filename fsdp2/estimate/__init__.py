"""``python -m fsdp2.estimate``: how much memory one rank of a large job needs, measured on this CPU (see ``session``)."""

from .session import Session, estimate, fake_distributed, format_report, main, parse_command

__all__ = ["Session", "estimate", "fake_distributed", "format_report", "main", "parse_command"]
