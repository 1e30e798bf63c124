"""The actor transport: reliable, de-duplicated actor messages over the network seam's streams."""
