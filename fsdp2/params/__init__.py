"""One managed parameter: its shard layout, its sharded DTensor and unsharded leaf, tensor-subclass wrapping, parameters two groups would share, and state-dict hooks; gathers nothing itself."""
