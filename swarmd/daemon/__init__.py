"""One daemon's process: the Node and its parts (compute thread, descriptor, served model, stage assignment)."""
