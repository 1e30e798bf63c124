"""Test tools shipped with the package: the in-memory network and the TCP link emulator."""
