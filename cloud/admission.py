"""Who may talk to the gateway: CURVE with a ZAP handler that allows enrolled keys only.

Two checks, so that a revocation needs no restart:

- at the handshake, pyzmq's ZAP authenticator (its own thread) asks
  `EnrolledDevices` whether the client's public key is enrolled, and stamps the
  connection with that public key as its ZeroMQ User-Id;
- on every message, the gateway reads the key from the frame and looks it up
  again: a device revoked (or re-keyed) while connected is refused from its
  next message.

The device's identity is therefore the name its key is enrolled under now,
never what it writes in a header.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from elasticfed.common.keys import EnrolledDevices, KeyFolder, KeyPair

log = logging.getLogger("elasticfed.gateway")

ZAP_DOMAIN = "elasticfed"
ZAP_BIND_WAIT_S = 2.0  # how long a new gateway waits for an old one's ZAP endpoint to be released


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, with the device name as User-Id and a log line per refusal."""

    def __init__(self, context: zmq.Context, admission: CurveAdmission) -> None:
        super().__init__(context, log=logging.getLogger("elasticfed.zap"))
        self.devices = admission.devices
        self.admission = admission
        self._address = ""
        self._last_log = -1e18
        self._quiet = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider's hook
        name = self.devices.device_for(key)
        if name is None:
            self.admission.handshakes_refused += 1
            now = time.monotonic()
            if now - self._last_log < 1.0:  # a knocking stranger must not fill the disk
                self._quiet += 1
            else:
                more = f" ({self._quiet} more refusals not logged)" if self._quiet else ""
                self._last_log, self._quiet = now, 0
                log.warning(
                    "refused a CURVE handshake from %s: public key %s is not enrolled%s",
                    self._address,
                    key.decode("ascii", "replace"),
                    more,
                )
        return name is not None

    def curve_user_id(self, client_public_key: bytes) -> str:
        return zmq.utils.z85.encode(client_public_key).decode("ascii")


class CurveAdmission:
    """CURVE server keys, the ZAP thread and the per-message identity check, for one ROUTER socket."""

    def __init__(self, keys: KeyPair, devices: EnrolledDevices) -> None:
        if keys.secret is None:
            raise ValueError("the gateway needs its secret key")
        self.keys = keys
        self.devices = devices
        self.handshakes_refused = 0  # counted by the ZAP thread
        self._auth: _Authenticator | None = None

    @classmethod
    def from_folder(cls, folder: str) -> CurveAdmission:
        """The gateway's key folder (see common/keys.py); raises KeyFileError naming what is wrong."""
        keys = KeyFolder(folder)
        pair = keys.gateway_keys()
        return cls(pair, EnrolledDevices(keys.enrolled_dir))

    def secure(self, sock: zmq.Socket) -> None:
        """Before bind: CURVE server on `sock`, with the ZAP thread started in its context."""
        if self._auth is None:
            self._auth = self._start_authenticator(sock.context)
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        # Without it, libzmq lets a CURVE handshake through unauthenticated whenever no ZAP handler
        # answers (RFC 27's old default); with it, such a handshake fails instead (libzmq >= 4.3).
        if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def _start_authenticator(self, context: zmq.Context) -> _Authenticator:
        """The ZAP thread, bound to the context's one ZAP endpoint (inproc://zeromq.zap.01).

        A gateway stopped earlier in this process (a restart, a test) releases that endpoint
        asynchronously: libzmq's reaper unbinds it after the old handler's socket closed.  A bind
        that finds it still taken is retried until ZAP_BIND_WAIT_S; a failed start leaves nothing
        half-started behind (once, a half-started handler stayed set after such a failure and
        every later handshake failed: no ZAP handler answered).
        """
        deadline = time.monotonic() + ZAP_BIND_WAIT_S
        while True:
            auth = _Authenticator(context, self)
            try:
                auth.start()
            except zmq.ZMQError as exc:
                auth.stop()  # closes the ZAP socket its failed bind created
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise zmq.ZMQError(
                        exc.errno,
                        f"cannot start the CURVE authenticator: the ZAP endpoint of this process is "
                        f"taken ({exc}); is another gateway still running in this process?",
                    ) from exc
                time.sleep(0.01)  # the reaper thread releases it; nothing to wait on but time
                continue
            auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=auth)
            return auth

    def identity(self, user_id: str | None) -> str | None:
        """The enrolled name of the key behind a message (its ZAP User-Id); None if none, or revoked."""
        if not user_id:
            return None
        return self.devices.device_for(user_id.encode("ascii", "replace"))

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
