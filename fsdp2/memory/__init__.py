"""What ``fsdp2.estimate`` and ``fsdp2.plan`` measure with: live tensor bytes of one rank by category and their peak, and collectives that deliver as if every rank held this one's data."""
