"""A TLS data plane for tensors beside libp2p, which stays the control plane and the fallback.

py-libp2p costs about 1 ms of CPU per small frame on each side (docs: ../shared notes, docs/BENCHMARKS.md),
so frames can travel instead over a plain TCP connection wrapped in TLS (the standard `ssl` module through
`trio.SSLStream`). Trust comes from libp2p: each daemon makes a throw-away self-signed certificate at start;
a dialer receives it inside the listener's `Hello` on the authenticated libp2p stream and pins exactly that
certificate. The listener, in the same `Hello`, hands the dialer a one-time token; the first frame on the
TLS connection must be that token (`Attach`), which tells the listener which libp2p peer is on the other end.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmd.transport.transport import ActorTransport, ByteStream, LinkError, TrioStream, read_frame
from swarmd.wire.messages import Ack, Attach, Hello, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlaneConfig:
    bind_host: str = "127.0.0.1"  # a daemon serving other machines binds the interface libp2p listens on
    bind_port: int = 0
    announce_host: str = ""  # where dialers should connect; "" = the address they reached us at over libp2p
    token_ttl: float = 30.0  # a token not used within this long is void
    handshake_timeout: float = 10.0
    connect_timeout: float = 3.0  # a dial the network swallows falls back to libp2p this soon
    max_pending_tokens: int = 4096
    max_handshakes: int = 64  # connections still in TLS set-up at once; more are closed at once


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
    """TLS listener handing verified connections to an `ActorTransport`, and the matching dialer."""

    def __init__(self, transport: ActorTransport, local_peer: str, config: DataPlaneConfig | None = None) -> None:
        self.transport = transport
        self.config = config or DataPlaneConfig()
        self.cert_der, key_pem = make_certificate(local_peer)
        self._server_ctx = server_context(self.cert_der, key_pem)
        self._client_ctx: dict[bytes, ssl.SSLContext] = {}
        self._tokens: dict[bytes, tuple[str, float]] = {}  # token -> (peer, expiry)
        self._inbound: dict[str, set[trio.SocketStream]] = {}  # attached connections by peer
        self._handshakes = trio.Semaphore(self.config.max_handshakes)
        self.port = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.config.bind_port, host=self.config.bind_host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve_connection, listeners)
            task_status.started()

    def offer(self, peer: str, max_frame: int) -> Hello:
        """The `Hello` answer that lets `peer` (authenticated by libp2p) attach one TLS connection."""
        now = trio.current_time()
        self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
        if len(self._tokens) >= self.config.max_pending_tokens:
            return Hello(max_frame)  # too many unused tokens: offer no TLS, the link stays on libp2p
        token = secrets.token_bytes(16)
        self._tokens[token] = (peer, now + self.config.token_ttl)
        return Hello(max_frame, tls_host=self.config.announce_host, tls_port=self.port, tls_cert=self.cert_der,
                     tls_token=token)

    async def dial(self, hello: Hello, fallback_host: str = "") -> ByteStream:
        """Open a TLS connection to the listener that sent `hello`, pinned to its certificate, and attach.

        `fallback_host` (the peer's address on the libp2p connection) is used when the hello names none.
        """
        host = hello.tls_host or fallback_host
        if not host:
            raise LinkError("the data plane offer names no address and the libp2p one is unknown")
        ctx = self._client_ctx.get(hello.tls_cert)
        if ctx is None:
            ctx = self._client_ctx[hello.tls_cert] = pinned_client_context(hello.tls_cert)
        with trio.fail_after(self.config.handshake_timeout):
            with trio.fail_after(self.config.connect_timeout):
                tcp = await trio.open_tcp_stream(host, hello.tls_port)
            tls = trio.SSLStream(tcp, ctx)
            stream = TrioStream(tls)
            try:
                await tls.do_handshake()
                if tls.getpeercert(binary_form=True) != hello.tls_cert:
                    raise LinkError("the TLS peer's certificate is not the one pinned over libp2p")
                await stream.write(encode(Attach(hello.tls_token)))
                answer = await read_frame(stream, 4096)
                if not isinstance(answer.msg, Ack):
                    raise LinkError(f"data plane refused the token: {answer.msg}")
            except BaseException:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await tcp.aclose()
                raise
        return stream

    async def _serve_connection(self, tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, self._server_ctx, server_side=True)
        stream = TrioStream(tls)
        peer = None
        try:
            self._handshakes.acquire_nowait()
        except trio.WouldBlock:
            log.info("data-plane connection refused: %d set-ups already running", self.config.max_handshakes)
        else:
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    await tls.do_handshake()
                    env = await read_frame(stream, 4096)
                    if isinstance(env.msg, Attach):
                        peer = self._redeem(env.msg.token)
                    if peer is not None:
                        await stream.write(encode(Ack()))
            except Exception as e:
                log.info("data-plane connection dropped during set-up: %s: %s", type(e).__name__, e)
            finally:
                self._handshakes.release()
        if peer is None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await tcp.aclose()
            return
        conns = self._inbound.setdefault(peer, set())
        conns.add(tcp)
        try:
            await self.transport.serve(peer, stream)  # closes the stream; never raises
        finally:
            conns.discard(tcp)
            if not conns:
                self._inbound.pop(peer, None)

    def connections(self, peer: str) -> int:
        """How many attached data-plane connections `peer` has with us."""
        return len(self._inbound.get(peer, ()))

    async def drop(self, peer: str) -> None:
        """Cut `peer`'s data-plane connections at the TCP level (a penalised peer, or a test's fault)."""
        for tcp in list(self._inbound.get(peer, ())):
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await tcp.aclose()

    def _redeem(self, token: bytes) -> str | None:
        entry = self._tokens.pop(token, None)
        if entry is None or entry[1] <= trio.current_time():
            log.info("data-plane connection with an unknown or expired token")
            return None
        return entry[0]
