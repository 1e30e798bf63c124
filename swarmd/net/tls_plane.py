"""The TLS data plane: bulk streams (activations) on plain TCP connections wrapped in TLS, beside libp2p.

py-libp2p costs about a millisecond of CPU per small frame on each side (docs/BENCHMARKS.md), so
`Libp2pNetwork` carries bulk streams here when both ends run a data plane. Trust comes from libp2p: each
daemon makes a throw-away self-signed certificate at start. A dialer asks for a stream of a protocol on
`/swarmd/plane/1.0.0`, an authenticated libp2p stream; the listener answers with an `Offer`: where its plane
listens, its certificate (which the dialer pins) and a one-time token. The first frame on the TLS connection
must be that token, which tells the listener which libp2p peer is on the other end and which protocol the
stream speaks; the listener answers `ok` and hands the stream to that protocol's handler.

Each stream is a `swarmd.net.tls_stream.TlsStream`: read and written by the event loop, or detached from it
(`detach()`) and driven by a thread of its own.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import ssl
import struct
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmd.errors import RemoteProtocolError
from swarmd.net.seam import PeerUnreachable, Stream
from swarmd.net.streams import close_quietly, read_frame, write_frame
from swarmd.net.tls_stream import TlsStream, socket_of

log = logging.getLogger(__name__)

PLANE_PROTOCOL = "/swarmd/plane/1.0.0"
TOKEN_BYTES = 16
ATTACHED = b"ok"
MAX_HANDSHAKE_FRAME = 8192
_OFFER = struct.Struct(">HBH")  # port, host length, certificate length; then host, certificate, token

Accept = Callable[[str, str, Stream], Awaitable[None]]  # (peer, protocol, stream): serve an attached stream


@dataclass(frozen=True)
class DataPlaneConfig:
    bind_host: str = ""  # "": where the daemon's libp2p listener binds (Libp2pNetwork sets it), else loopback
    bind_port: int = 0
    announce_host: str = ""  # where dialers should connect; "" = the address they reached us at over libp2p
    token_ttl: float = 30.0  # a token not used within this long is void
    handshake_timeout: float = 10.0
    connect_timeout: float = 3.0  # a dial the network swallows falls back to libp2p this soon
    max_pending_tokens: int = 4096
    max_handshakes: int = 64  # connections still in TLS set-up at once; more are closed at once


@dataclass(frozen=True)
class Offer:
    """The listener's answer on `/swarmd/plane/1.0.0`: dial `host:port`, pin `cert`, present `token`."""

    host: str
    port: int
    cert: bytes
    token: bytes

    def encode(self) -> bytes:
        host = self.host.encode()
        return _OFFER.pack(self.port, len(host), len(self.cert)) + host + self.cert + self.token

    @classmethod
    def decode(cls, data: bytes) -> Offer:
        try:
            port, host_len, cert_len = _OFFER.unpack_from(data)
            at = _OFFER.size
            host = data[at : at + host_len].decode()
            cert = data[at + host_len : at + host_len + cert_len]
            token = data[at + host_len + cert_len :]
        except (struct.error, UnicodeDecodeError) as e:
            raise RemoteProtocolError(f"data-plane offer is malformed: {e}") from None
        if len(cert) != cert_len or len(token) != TOKEN_BYTES or not 0 < port < 65536:
            raise RemoteProtocolError("data-plane offer is malformed: wrong lengths or port")
        return cls(host, port, cert, token)


def make_certificate(common_name: str) -> tuple[bytes, bytes]:
    """A fresh self-signed certificate (DER) and its private key (PEM) for this process only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.DER), key_pem


def server_context(cert_der: bytes, key_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    cert_pem = ssl.DER_cert_to_PEM_cert(cert_der).encode()
    # load_cert_chain reads files only: write them to a private directory for the moment it takes.
    with tempfile.TemporaryDirectory(prefix="swarmd-tls-") as tmp:
        path = os.path.join(tmp, "cert.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + key_pem)
        ctx.load_cert_chain(path)
    return ctx


def pinned_client_context(cert_der: bytes) -> ssl.SSLContext:
    """Trusts exactly `cert_der` (the certificate received over libp2p), nothing else."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # identity is the pinned certificate, not a host name
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert_der)
    return ctx


class DataPlane:
    """The TLS listener handing attached streams to `accept`, and the matching dialer."""

    def __init__(self, local_peer: str, accept: Accept, config: DataPlaneConfig | None = None) -> None:
        self.config = config or DataPlaneConfig()
        self._accept = accept
        self.cert_der, key_pem = make_certificate(local_peer)
        self._server_ctx = server_context(self.cert_der, key_pem)
        self._client_ctx: dict[bytes, ssl.SSLContext] = {}
        self._tokens: dict[bytes, tuple[str, str, float]] = {}  # token -> (peer, protocol, expiry)
        self._inbound: dict[str, set[TlsStream]] = {}  # attached connections by peer
        self._handshakes = trio.Semaphore(self.config.max_handshakes)
        self.port = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.config.bind_port, host=self.config.bind_host or "127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve_connection, listeners)
            task_status.started()

    def offer(self, peer: str, protocol: str) -> Offer | None:
        """What lets `peer` (authenticated by libp2p) attach one TLS stream of `protocol`; None when too many
        tokens are pending (the dialer then stays on libp2p)."""
        now = trio.current_time()
        self._tokens = {t: v for t, v in self._tokens.items() if v[2] > now}
        if len(self._tokens) >= self.config.max_pending_tokens or not self.port:
            return None
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[token] = (peer, protocol, now + self.config.token_ttl)
        return Offer(self.config.announce_host, self.port, self.cert_der, token)

    async def dial(self, offer: Offer, fallback_host: str = "") -> Stream:
        """Open a TLS connection to the listener that made `offer`, pinned to its certificate, and attach.

        `fallback_host` (the peer's address on the libp2p connection) is used when the offer names none.
        """
        host = offer.host or fallback_host
        if not host:
            raise PeerUnreachable("the data-plane offer names no address and the libp2p one is unknown")
        ctx = self._client_ctx.get(offer.cert)
        if ctx is None:
            ctx = self._client_ctx[offer.cert] = pinned_client_context(offer.cert)
        with trio.fail_after(self.config.handshake_timeout):
            with trio.fail_after(self.config.connect_timeout):
                tcp = await trio.open_tcp_stream(host, offer.port)
            stream = TlsStream(socket_of(tcp), ctx, server_side=False)
            try:
                await stream.handshake()
                if stream.getpeercert(binary_form=True) != offer.cert:
                    raise PeerUnreachable("the TLS peer's certificate is not the one pinned over libp2p")
                await write_frame(stream, offer.token)
                if await read_frame(stream, len(ATTACHED)) != ATTACHED:
                    raise PeerUnreachable("the data plane refused the token")
            except BaseException:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await stream.reset()
                raise
        return stream

    async def _serve_connection(self, tcp: trio.SocketStream) -> None:
        stream = TlsStream(socket_of(tcp), self._server_ctx, server_side=True)
        attached: tuple[str, str] | None = None
        try:
            self._handshakes.acquire_nowait()
        except trio.WouldBlock:
            log.info("data-plane connection refused: %d set-ups already running", self.config.max_handshakes)
        else:
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    await stream.handshake()
                    attached = self._redeem(await read_frame(stream, TOKEN_BYTES))
                    if attached is not None:
                        await write_frame(stream, ATTACHED)
            except Exception as e:
                log.info("data-plane connection dropped during set-up: %s: %s", type(e).__name__, e)
                attached = None
            finally:
                self._handshakes.release()
        if attached is None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.reset()
            return
        peer, protocol = attached
        conns = self._inbound.setdefault(peer, set())
        conns.add(stream)
        try:
            await self._accept(peer, protocol, stream)
        finally:
            conns.discard(stream)
            if not conns:
                self._inbound.pop(peer, None)
            await close_quietly(stream)

    def connections(self, peer: str) -> int:
        """How many attached data-plane connections `peer` has with us."""
        return len(self._inbound.get(peer, ()))

    async def drop(self, peer: str) -> None:
        """Cut `peer`'s data-plane connections at the TCP level (a penalised peer, or a test's fault)."""
        for stream in list(self._inbound.get(peer, ())):
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.reset()

    def _redeem(self, token: bytes) -> tuple[str, str] | None:
        entry = self._tokens.pop(token, None)
        if entry is None or entry[2] <= trio.current_time():
            log.info("data-plane connection with an unknown or expired token")
            return None
        return entry[0], entry[1]
