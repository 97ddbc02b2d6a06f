"""The training step: one ``fully_shard`` call's group and its lifecycle (unshard, reshard, pre/post forward and backward), its forward calls, and the root's hooks and step context."""
