"""`elasticfed keys ...`: make CURVE keys, enrol and revoke devices, list them.

The usual sequence (DESIGN.md guarantee 4; details in the README):

    gateway$ elasticfed keys init --keys-dir /etc/elasticfed/keys        # gateway key pair
    device$  elasticfed keys generate --name cam-7 --out-dir /etc/elasticfed/keys
    (copy the device's cam-7.key to the gateway, the gateway's gateway.key to the device)
    gateway$ elasticfed keys enrol --keys-dir /etc/elasticfed/keys --public-key cam-7.key
    gateway$ elasticfed keys revoke --keys-dir /etc/elasticfed/keys --name cam-7   # no restart needed

Secret keys stay where they were made; only public keys are copied or printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elasticfed.common.config import setting
from elasticfed.common.exits import fail
from elasticfed.common.keys import (
    PUBLIC_SUFFIX,
    KeyFileError,
    KeyFolder,
    check_name,
    generate,
    read_key_file,
)


def _name(value: str) -> str | None:
    if not value:
        return None
    try:
        check_name(value)
    except KeyFileError as exc:
        return str(exc)
    return None


def _keys_dir() -> str:
    return setting("", "the gateway's key folder (gateway key pair, enrolled/ and revoked/)")


@dataclass(frozen=True)
class KeysInitConfig:
    keys_dir: str = _keys_dir()
    force: bool = setting(False, "replace an existing gateway key pair (every device must get the new key)")


@dataclass(frozen=True)
class KeysGenerateConfig:
    name: str = setting("", "device name: its client id, and the key files' names", check=_name)
    out_dir: str = setting(".", "folder to write NAME.key and NAME.key_secret (0600) into")
    force: bool = setting(False, "replace an existing key pair of that name")


@dataclass(frozen=True)
class KeysEnrolConfig:
    keys_dir: str = _keys_dir()
    public_key: str = setting(
        "", "the device's public key file (NAME.key), or a folder: every NAME.key in it, as NAME"
    )
    name: str = setting("", "enrol under this device name (default: the name in the key file)", check=_name)
    force: bool = setting(False, "replace the key of a device enrolled under the same name")


@dataclass(frozen=True)
class KeysRevokeConfig:
    keys_dir: str = _keys_dir()
    name: str = setting("", "the device to revoke", check=_name)


@dataclass(frozen=True)
class KeysListConfig:
    keys_dir: str = _keys_dir()
    json: bool = setting(False, "print JSON lines instead of a table")


def _fail(command: str, message: str) -> int:
    return fail(f"keys {command}", message)


def _run(command: str, required: dict[str, str], action: Callable[[], list[str]]) -> int:
    """Check the required flags, run `action`, print its lines; errors name the file and exit 2."""
    for flag, value in required.items():
        if not value:
            return _fail(command, f"--{flag.replace('_', '-')} is required")
    try:
        lines = action()
    except (KeyFileError, OSError) as exc:
        return _fail(command, str(exc))
    for line in lines:
        print(line)
    return 0


def init(args: argparse.Namespace, config: KeysInitConfig) -> int:
    def action() -> list[str]:
        public = KeyFolder(config.keys_dir).init(force=config.force)
        return [
            f"gateway key folder ready: {config.keys_dir}",
            f"give every device the gateway's public key: {public}",
            f"public key: {read_key_file(public).public.decode()}",
        ]

    return _run("init", {"keys_dir": config.keys_dir}, action)


def generate_pair(args: argparse.Namespace, config: KeysGenerateConfig) -> int:
    def action() -> list[str]:
        public, secret = generate(config.name, config.out_dir, force=config.force)
        return [
            f"secret key (keep on the device, mode 0600): {secret}",
            f"public key (enrol it on the gateway): {public}",
            f"public key: {read_key_file(public).public.decode()}",
        ]

    return _run("generate", {"name": config.name}, action)


def enrol(args: argparse.Namespace, config: KeysEnrolConfig) -> int:
    def action() -> list[str]:
        if Path(config.public_key).is_dir():
            return enrol_folder()
        name = config.name or read_key_file(config.public_key).name
        if not name:
            raise KeyFileError(f"{config.public_key} names no device; pass --name")
        path = KeyFolder(config.keys_dir).enrol(name, config.public_key, force=config.force)
        return [f"enrolled {name}: {path}"]

    def enrol_folder() -> list[str]:
        """A fleet at once: every device's key checked before any is enrolled."""
        if config.name:
            raise KeyFileError(
                f"--name names one device; the keys in {config.public_key} are enrolled under the "
                "names their files hold"
            )
        files = sorted(Path(config.public_key).glob(f"*{PUBLIC_SUFFIX}"))
        if not files:
            raise KeyFileError(f"{config.public_key}: no public key files (*{PUBLIC_SUFFIX}) in this folder")
        devices = []
        for path in files:
            name = read_key_file(path).name
            if not name:
                raise KeyFileError(f"{path} names no device; enrol it alone with --name")
            devices.append((name, path))
        KeyFolder(config.keys_dir).enrol_many(devices, force=config.force)
        return [f"enrolled {len(devices)} devices from {config.public_key}"]

    return _run("enrol", {"keys_dir": config.keys_dir, "public_key": config.public_key}, action)


def revoke(args: argparse.Namespace, config: KeysRevokeConfig) -> int:
    def action() -> list[str]:
        path = KeyFolder(config.keys_dir).revoke(config.name)
        return [f"revoked {config.name} (kept as {path}); a running gateway refuses it within a second"]

    return _run("revoke", {"keys_dir": config.keys_dir, "name": config.name}, action)


def list_devices(args: argparse.Namespace, config: KeysListConfig) -> int:
    def action() -> list[str]:
        lines = []
        for e in KeyFolder(config.keys_dir).entries():
            since = datetime.datetime.fromtimestamp(e.since, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
            if config.json:
                lines.append(
                    json.dumps({"name": e.name, "status": e.status, "public_key": e.public, "since": e.since})
                )
            else:
                lines.append(f"{e.name:<24} {e.status:<9} {since} UTC  {e.public}")
        return lines or ([] if config.json else ["no devices enrolled"])

    return _run("list", {"keys_dir": config.keys_dir}, action)
