"""Home of the generated ``FSDP<Name>`` classes, so they have importable names."""

from __future__ import annotations

generated: dict[type, type] = {}
