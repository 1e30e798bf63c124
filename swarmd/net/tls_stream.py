"""A TLS connection on a plain socket, driven by the event loop or, once detached, by a thread of its own.

The data plane's streams (`swarmd.net.tls_plane`) are `TlsStream`s. On the event loop they are a seam `Stream`
(`read`, `write`): the TLS state machine is `ssl.SSLObject` over memory buffers, the socket non-blocking and
waited on with trio. `detach()` takes the stream off the event loop for good (`swarmd.net.seam.DetachedStream`): a
thread of its own waits on the socket, decrypts what arrives and hands it to a reader, and any thread may
write (a blocking write, one whole TLS record at a time). That is how a token's bytes travel without waiting
for the event loop (`swarmd.transport.lane`).

Only TLS 1.3 is spoken (the contexts of `tls_plane` set it), so there is no renegotiation; what the TLS layer
itself must send after the handshake (session tickets, key updates) is sent by whoever made it appear.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import ssl
import threading
import time
from typing import Any

import trio

from swarmd.net.seam import Reader, StreamClosed

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 16
WRITE_WAIT = 10.0  # s a blocking write waits for room in the socket before the stream is given up
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


def socket_of(stream: trio.SocketStream) -> socket.socket:
    """The plain socket under a trio TCP stream, which gives it up (its own close does nothing afterwards)."""
    return socket.socket(fileno=stream.socket.detach())


class TlsStream:
    """One TLS connection. Event-loop face: `handshake`, `read`, `write`, `close`, `reset`; after `detach()`:
    `start(reader)`, `send(data)` from any thread, `close_now()`."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._ssl_lock = threading.Lock()  # the SSL object, between a detached stream's reader and its writers
        self._send_lock = threading.Lock()  # one writer at a time: records leave whole and in order
        self._closed = ""  # why, once closed
        self._detached = False
        self._reader: threading.Thread | None = None

    # --- the event loop's face ---------------------------------------------------------------------------
    def getpeercert(self, binary_form: bool = True) -> Any:
        return self._ssl.getpeercert(binary_form=binary_form)

    async def handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    raise StreamClosed("the peer closed the connection during the TLS handshake") from None
                continue
            except ssl.SSLError as e:
                raise StreamClosed(f"TLS handshake failed: {e}") from None
            await self._flush()
            return

    async def read(self, n: int) -> bytes:
        self._check_attached()
        waited = False
        while True:
            try:
                data = self._ssl.read(n)
            except ssl.SSLWantReadError:
                await self._flush()  # what the TLS layer wants said first (a key update's answer)
                if not await self._feed():
                    return b""
                waited = True
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError as e:
                raise StreamClosed(f"TLS error: {e}") from None
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    async def write(self, data: bytes) -> None:
        self._check_attached()
        if self._closed:
            raise StreamClosed(self._closed)
        try:
            self._ssl.write(data)
        except ssl.SSLError as e:
            raise StreamClosed(f"TLS error: {e}") from None
        await self._flush()

    async def close(self) -> None:
        """Say goodbye (TLS close_notify) if the socket takes it at once, then close."""
        if not self._detached and not self._closed:
            with contextlib.suppress(ssl.SSLError, OSError):
                self._ssl.unwrap()
            with contextlib.suppress(OSError):
                self._sock.send(self._outgoing.read())
        await self.reset()

    async def reset(self) -> None:
        if not self._detached:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        self.close_now("closed here")
        await trio.lowlevel.checkpoint()

    async def _feed(self) -> bool:
        """Wait for bytes from the socket and give them to TLS; False at the end of the stream."""
        while True:
            if self._closed:
                raise StreamClosed(self._closed)
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError:
                    raise StreamClosed(self._closed or "closed here") from None
                continue
            except OSError as e:
                raise StreamClosed(f"read failed: {_why(e)}") from None
            if not data:
                self._incoming.write_eof()
                return False
            self._incoming.write(data)
            return True

    async def _flush(self) -> None:
        data = self._outgoing.read()
        view = memoryview(data)
        while view:
            if self._closed:
                raise StreamClosed(self._closed)
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(self._sock)
                except trio.ClosedResourceError:
                    raise StreamClosed(self._closed or "closed here") from None
                continue
            except OSError as e:
                raise StreamClosed(f"write failed: {_why(e)}") from None
            view = view[sent:]

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError("this stream was detached from the event loop: use send() and a reader")

    # --- detached: a thread of its own ---------------------------------------------------------------------
    def detach(self) -> TlsStream:
        """Take the stream off the event loop (nothing may be waiting on it there): `start` a reader thread and
        `send` from any thread from now on."""
        self._detached = True
        return self

    def start(self, reader: Reader) -> None:
        self._reader = threading.Thread(target=self._read_loop, args=(reader,), name="swarmd-link", daemon=True)
        self._reader.start()

    def send(self, data: bytes, wait: float = WRITE_WAIT) -> None:
        """Encrypt and write `data` whole (blocking, at most `wait` s for room in the socket); StreamClosed when
        the stream is gone (then it is closed)."""
        with self._send_lock:
            if self._closed:
                raise StreamClosed(self._closed)
            with self._ssl_lock:
                try:
                    self._ssl.write(data)
                except ssl.SSLError as e:
                    self.close_now(f"TLS error: {e}")
                    raise StreamClosed(self._closed) from None
                record = self._outgoing.read()
            self._send_raw(record, wait)

    def close_now(self, reason: str = "closed here") -> None:
        """Close from any thread: the reader (if any) ends with `closed(reason)`."""
        if self._closed:
            return
        self._closed = reason
        if self._detached:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader, which closes the socket
            if self._reader is None:
                with contextlib.suppress(OSError):
                    self._sock.close()

    def _send_raw(self, data: bytes, wait: float) -> None:
        """Write `data` whole (the send lock held); a write that cannot finish closes the stream."""
        view = memoryview(data)
        deadline = 0.0
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + wait
                if now >= deadline or not _wait_for(self._sock, select.POLLOUT, deadline - now):
                    self.close_now(f"no room to write for {wait:g} s")
                    raise StreamClosed(self._closed) from None
                continue
            except OSError as e:
                self.close_now(f"write failed: {_why(e)}")
                raise StreamClosed(self._closed) from None
            view = view[sent:]

    def _read_loop(self, reader: Reader) -> None:
        reason = ""
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            timeout = reader.tick()
            while not self._closed:
                events = poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
                if not events:
                    timeout = reader.tick()
                    continue
                try:
                    data = self._sock.recv(RECV_BYTES)
                except BlockingIOError:
                    continue
                if not data:
                    reason = "the peer closed the stream"
                    break
                plain, reply = self._decrypt(data)
                if reply:
                    with self._send_lock:
                        self._send_raw(reply, WRITE_WAIT)
                if plain is None:
                    reason = "the peer ended the TLS session"
                    break
                if plain:
                    reader.data(plain)
                timeout = reader.tick()
        except StreamClosed as e:
            reason = str(e)
        except OSError as e:
            reason = f"read failed: {_why(e)}"
        except Exception as e:  # a reader's bug: the link goes, the daemon stays
            log.exception("a data-plane reader failed")
            reason = f"reader failed: {type(e).__name__}: {e}"
        finally:
            self.close_now(reason or self._closed or "closed")
            with contextlib.suppress(OSError):
                self._sock.close()
            reader.closed(self._closed)

    def _decrypt(self, data: bytes) -> tuple[bytes | None, bytes]:
        """(plaintext so far, or None at the end of the session; bytes TLS wants sent back)."""
        parts: list[bytes] = []
        ended = False
        with self._ssl_lock:
            self._incoming.write(data)
            while True:
                try:
                    chunk = self._ssl.read(RECV_BYTES)
                except ssl.SSLWantReadError:
                    break
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    ended = True
                    break
                except ssl.SSLError as e:
                    raise StreamClosed(f"TLS error: {e}") from None
                if not chunk:
                    ended = True
                    break
                parts.append(chunk)
                if not self._incoming.pending and not self._ssl.pending():
                    break  # all read: another read would only raise SSLWantReadError
            reply = self._outgoing.read()
        plain = parts[0] if len(parts) == 1 else b"".join(parts)
        if ended and not plain:
            return None, reply
        return plain, reply


def _wait_for(sock: socket.socket, event: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(max(0, int(timeout * 1000) + 1)))


def _why(e: OSError) -> str:
    if isinstance(e, _GONE):
        return type(e).__name__
    return errno.errorcode.get(e.errno or 0, type(e).__name__) if e.errno else str(e)
