"""CURVE keys on disk and the gateway's list of enrolled devices.

Key files use the ZeroMQ certificate format (the one czmq's zcert and
`zmq.auth.load_certificate` read), so other ZeroMQ tools can use them:
`NAME.key` holds the public key, `NAME.key_secret` the public and the secret
key and is written with mode 0600.  A secret key file readable by others is
refused, as ssh refuses such a private key.

The gateway's key folder (`elasticfed keys init --keys-dir DIR`):

    DIR/gateway.key            the gateway's public key: give it to every device
    DIR/gateway.key_secret     its secret key (0600)
    DIR/enrolled/NAME.key      one public key per allowed device; NAME is its client id
    DIR/revoked/NAME.key       keys taken out of enrolled/ (kept, for the record)

`EnrolledDevices` reads `enrolled/` and notices changes while the gateway
runs, which is how a revocation takes effect without a restart.  Nothing here
ever logs or prints a secret key.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

GATEWAY_NAME = "gateway"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_LINE = re.compile(r'^\s*(public-key|secret-key|name)\s*=\s*"([^"]*)"\s*$')


class KeyFileError(ValueError):
    """A key file or key folder is wrong; the message names the file and the problem."""


def check_name(name: str) -> str:
    """Device names become file names and client ids: letters, digits, '.', '_', '-'."""
    if not _NAME.fullmatch(name) or name.endswith((PUBLIC_SUFFIX, SECRET_SUFFIX)):
        raise KeyFileError(
            f"device name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


@dataclass(frozen=True)
class KeyPair:
    """Z85 text of a CURVE key pair; `secret` is None for a public key file."""

    public: bytes
    secret: bytes | None = None
    name: str = ""  # the file's metadata name, if any

    def __repr__(self) -> str:  # never show a secret key, even in a traceback
        hidden = "<hidden>" if self.secret else None
        return f"KeyPair(name={self.name!r}, public={self.public.decode()!r}, secret={hidden})"


def _render(name: str, public: bytes, secret: bytes | None) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    kind = "**Secret** Certificate" if secret else "Public Certificate"
    lines = [
        f"#   ****  Generated on {stamp} by elasticfed  ****",
        f"#   ZeroMQ CURVE {kind}",
    ]
    if secret:
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata", f'    name = "{name}"', "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str, mode: int, replace: bool) -> None:
    # An unpredictable temporary name, created 0600 and set to `mode` through the descriptor:
    # nobody sharing the folder can swap or read it in between.
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # fails if `path` exists: never overwrite a key by accident
        except FileExistsError:
            raise KeyFileError(f"{path}: exists already") from None
        except OSError:  # a file system without hard links (FAT, some network mounts)
            if path.exists():
                raise KeyFileError(f"{path}: exists already") from None
            os.replace(tmp, path)
            return
        tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_key_file(path: str | os.PathLike[str], need_secret: bool = False) -> KeyPair:
    """Parse a key file; with `need_secret`, also check it holds a secret key that only its owner reads."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read the key file ({exc})") from None
    if st.st_size > 4096:
        raise KeyFileError(f"{path}: {st.st_size} bytes is too large for a key file")
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = _LINE.match(line)
        if match:
            key, value = match.groups()
            if key != "name" and not _Z85.match(value):
                raise KeyFileError(f"{path}: line {number}: {key} is not 40 Z85 characters")
            values[key] = value
    if "public-key" not in values:
        raise KeyFileError(f"{path}: no public-key line; is this a ZeroMQ certificate?")
    public = values["public-key"].encode()
    secret = values["secret-key"].encode() if "secret-key" in values else None
    if need_secret:
        if secret is None:
            raise KeyFileError(f"{path}: holds no secret-key (a .key file is the public half)")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"{path}: a secret key must be readable by its owner only "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
            )
        if zmq.curve_public(secret) != public:
            raise KeyFileError(f"{path}: the public key does not belong to the secret key")
    return KeyPair(public, secret, values.get("name", ""))


def generate(name: str, directory: str | os.PathLike[str], force: bool = False) -> tuple[Path, Path]:
    """A new key pair as `NAME.key` and `NAME.key_secret` (0600) in `directory`."""
    check_name(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    if not force:
        for p in (public_path, secret_path):
            if p.exists():
                raise KeyFileError(f"{p}: exists already (pass --force to replace the key pair)")
    public, secret = zmq.curve_keypair()
    _write_atomic(secret_path, _render(name, public, secret), 0o600, replace=force)
    _write_atomic(public_path, _render(name, public, None), 0o644, replace=force)
    return public_path, secret_path


@dataclass(frozen=True)
class DeviceEntry:
    name: str
    public: str
    status: str  # "enrolled" or "revoked"
    since: float  # when the key file got its place (enrolment or revocation), seconds since the epoch


class KeyFolder:
    """The gateway's key folder: its own key pair, enrolled and revoked device keys."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.enrolled_dir = self.root / "enrolled"
        self.revoked_dir = self.root / "revoked"

    @property
    def public_path(self) -> Path:
        return self.root / f"{GATEWAY_NAME}{PUBLIC_SUFFIX}"

    @property
    def secret_path(self) -> Path:
        return self.root / f"{GATEWAY_NAME}{SECRET_SUFFIX}"

    def init(self, force: bool = False) -> Path:
        """Create the folder and the gateway's key pair; returns the public key file to hand out."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (self.enrolled_dir, self.revoked_dir):
            d.mkdir(exist_ok=True, mode=0o700)
        if self.secret_path.exists() and not force:
            read_key_file(self.secret_path, need_secret=True)  # an existing folder must be sound
            return self.public_path
        public, _ = generate(GATEWAY_NAME, self.root, force=force)
        return public

    def gateway_keys(self) -> KeyPair:
        if not self.root.is_dir():
            raise KeyFileError(f"{self.root}: no such key folder; create it with `elasticfed keys init`")
        return read_key_file(self.secret_path, need_secret=True)

    def enrol(self, name: str, key_file: str | os.PathLike[str], force: bool = False) -> Path:
        """Allow the device whose public key is in `key_file` (a .key or .key_secret file) as `name`."""
        return self.enrol_many([(name, key_file)], force=force)[0]

    def enrol_many(
        self, devices: Sequence[tuple[str, str | os.PathLike[str]]], force: bool = False
    ) -> list[Path]:
        """Enrol (name, key file) pairs: all checked first (nothing is enrolled if one is wrong),
        the folder read once.  One at a time, 10,000 devices read the folder 10,000 times."""
        self._need_folder()
        by_key = {e.public: e.name for e in self.entries() if e.status == "enrolled"}
        batch: dict[str, tuple[str, bytes]] = {}  # public key -> (name, file)
        names: dict[str, str] = {}
        planned = []
        for name, key_file in devices:
            check_name(name)
            if name == GATEWAY_NAME:
                raise KeyFileError(f"{name!r} is the gateway's own name; choose another device name")
            if name in names:
                raise KeyFileError(f"{key_file}: device {name!r} is enrolled from {names[name]} as well")
            names[name] = str(key_file)
            public = read_key_file(key_file).public  # only the public half is ever copied
            other = by_key.get(public.decode())
            if other is not None and other != name:
                raise KeyFileError(f"{key_file}: this key is enrolled already, as {other!r}")
            twin = batch.get(public.decode())
            if twin is not None:
                raise KeyFileError(f"{key_file}: the same key as {twin[1]!r} (enrolled as {twin[0]!r})")
            batch[public.decode()] = (name, str(key_file))
            target = self.enrolled_dir / f"{name}{PUBLIC_SUFFIX}"
            if target.exists() and read_key_file(target).public != public and not force:
                raise KeyFileError(
                    f"{target}: device {name!r} is enrolled with another key (pass --force to replace it)"
                )
            planned.append((name, public, target))
        for name, public, target in planned:
            (self.revoked_dir / f"{name}{PUBLIC_SUFFIX}").unlink(missing_ok=True)
            _write_atomic(target, _render(name, public, None), 0o644, replace=True)
        return [target for _, _, target in planned]

    def revoke(self, name: str) -> Path:
        """Move the key out of enrolled/: new handshakes fail, the gateway refuses its messages."""
        check_name(name)
        self._need_folder()
        source = self.enrolled_dir / f"{name}{PUBLIC_SUFFIX}"
        if not source.exists():
            raise KeyFileError(f"{source}: device {name!r} is not enrolled")
        target = self.revoked_dir / f"{name}{PUBLIC_SUFFIX}"
        os.replace(source, target)
        return target

    def entries(self) -> list[DeviceEntry]:
        out = []
        for status, folder in (("enrolled", self.enrolled_dir), ("revoked", self.revoked_dir)):
            if not folder.is_dir():
                continue
            for path in sorted(folder.glob(f"*{PUBLIC_SUFFIX}")):
                out.append(
                    DeviceEntry(
                        path.name[: -len(PUBLIC_SUFFIX)],
                        read_key_file(path).public.decode(),
                        status,
                        path.stat().st_mtime,
                    )
                )
        return out

    def _need_folder(self) -> None:
        if not self.enrolled_dir.is_dir():
            raise KeyFileError(
                f"{self.root}: not a key folder (no enrolled/); create it with `elasticfed keys init`"
            )


_RACY_NS = 2_000_000_000  # a folder changed this recently may change again within its timestamp's tick


class EnrolledDevices:
    """The live allow-list: public key -> device name, re-read when `enrolled/` changes.

    Thread-safe: the ZAP handler (its own thread) and the gateway's thread both
    ask it.  A revocation is noticed within `refresh_s`; a key not found sends
    it to the folder at once (a device enrolled a moment ago must not be refused).
    A file that cannot be read is left out (see `problems`) rather than
    stopping the gateway.

    Fleet-sized: every message asks, so a check costs one stat of the folder
    (enrolling, revoking and the kubelet's swap of a mounted ConfigMap all change
    it); the folder is listed only when it changed, when it changed too recently
    for its timestamp to tell (as git treats racily clean files), or every
    `full_scan_s` (a key file edited in place changes no folder); and only key
    files that changed are read.  Listing and reading 10,000 keys on every check
    took 34 ms four times a second, and 240 ms after each enrolment, on the
    gateway's serving thread.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        refresh_s: float = 0.25,
        miss_gap_s: float = 0.05,
        full_scan_s: float = 10.0,
    ) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KeyFileError(f"{self.folder}: no such folder of enrolled device keys")
        mode = stat.S_IMODE(self.folder.stat().st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise KeyFileError(
                f"{self.folder}: others may write here and so enrol any key (mode {mode:04o}); "
                f"run: chmod 700 {self.folder}"
            )
        self.refresh_s = refresh_s
        self.miss_gap_s = miss_gap_s  # a key not found re-checks the folder at most this often
        self.full_scan_s = full_scan_s
        self._lock = threading.Lock()
        self._folder_seen: tuple[int, ...] = ()  # the folder's stat when last listed
        self._scanned = -1e18
        self._files: dict[str, tuple[tuple[int, ...], bytes | None, str]] = {}  # name -> (stat, key, problem)
        self._checked = -1e18
        self._by_key: dict[bytes, str] = {}
        self._names: frozenset[str] = frozenset()
        self.problems: list[str] = []
        self.reloads = 0
        self.scans = 0  # listings of the folder
        self.files_read = 0
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> bool:
        """Re-read the folder if it changed; checked at most every `refresh_s` (`miss_gap_s` when
        forced by a key not found).  True if the list changed.  Files are read outside the lock."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < (self.miss_gap_s if force else self.refresh_s):
                return False
            self._checked = now
        try:
            st = os.stat(self.folder)  # through a symlink: the kubelet swaps ..data
        except OSError as exc:
            self.problems = [f"{self.folder}: cannot read ({exc}); keeping the previous list"]
            return False
        seen = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        racy = time.time_ns() - st.st_mtime_ns < _RACY_NS
        if seen == self._folder_seen and not racy and now - self._scanned < self.full_scan_s:
            return False
        try:
            with os.scandir(self.folder) as it:
                files = {
                    e.name: (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
                    for e in it
                    if e.name.endswith(PUBLIC_SUFFIX) and not e.name.startswith(".")
                    for st in (e.stat(),)
                }
        except OSError as exc:
            self.problems = [f"{self.folder}: cannot list ({exc}); keeping the previous list"]
            return False
        self.scans += 1
        with self._lock:
            known = dict(self._files)
        if files.keys() == known.keys() and all(known[n][0] == sig for n, sig in files.items()):
            with self._lock:
                self._folder_seen, self._scanned = seen, now
            return False
        entries = {}
        for name, sig in files.items():
            old = known.get(name)
            if old is not None and old[0] == sig:
                entries[name] = old
                continue
            self.files_read += 1
            device = name[: -len(PUBLIC_SUFFIX)]
            try:
                check_name(device)
                entries[name] = (sig, read_key_file(self.folder / name).public, "")
            except KeyFileError as exc:
                entries[name] = (sig, None, str(exc))
        by_key = {key: name[: -len(PUBLIC_SUFFIX)] for name, (_, key, _) in sorted(entries.items()) if key}
        with self._lock:
            self._folder_seen, self._scanned = seen, now
            self._files = entries
            self._by_key = by_key
            self._names = frozenset(by_key.values())
            self.problems = [problem for _, _, problem in entries.values() if problem]
            self.reloads += 1
        return True

    def device_for(self, public_z85: bytes) -> str | None:
        """The enrolled name of a public key, or None (a miss looks at the folder again, throttled)."""
        self.refresh()
        name = self._by_key.get(public_z85)
        if name is None and self.refresh(force=True):  # enrolled a moment ago?
            name = self._by_key.get(public_z85)
        return name

    def is_enrolled(self, name: str) -> bool:
        self.refresh()
        return name in self._names

    def names(self) -> frozenset[str]:
        self.refresh()
        return self._names


def configure_client(sock: zmq.Socket, device: KeyPair, gateway_public: bytes) -> None:
    """Make `sock` a CURVE client that talks only to the gateway holding `gateway_public`'s secret."""
    if device.secret is None:
        raise KeyFileError("a device needs its secret key to connect")
    sock.curve_serverkey = gateway_public
    sock.curve_publickey = device.public
    sock.curve_secretkey = device.secret
