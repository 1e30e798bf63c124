"""A plan file's fleet on one machine: one `swarmd join` per slot, the links between regions emulated."""
