"""The three kinds of failure swarmd tells apart.

UserError: the user asked for something that cannot be done; one clear line, non-zero exit.
RemoteProtocolError: a peer sent something wrong; answer with an error or drop the peer, never crash.
LocalProtocolError: our own bug; fail loudly.
"""


class UserError(Exception):
    """A problem the user can fix; its message is one line that says what to do."""

    exit_code = 2


class RemoteProtocolError(Exception):
    """What a peer sent is invalid (bad frame, unknown type, wrong shape)."""


class LocalProtocolError(Exception):
    """We broke our own protocol: a bug."""
