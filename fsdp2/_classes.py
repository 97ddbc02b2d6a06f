"""Home of the generated ``FSDP<Name>`` classes, so they have importable names."""

from __future__ import annotations

# process-wide: classes are; one generated class per original class, shared by every
# model (it holds no state of its own).
generated: dict[type, type] = {}
