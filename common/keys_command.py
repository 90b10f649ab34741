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
import sys
from dataclasses import dataclass

from common.config import setting
from common.keys import KeyFileError, KeyFolder, check_name, generate, read_key_file


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
    public_key: str = setting("", "the device's public key file (NAME.key)")
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
    print(f"elasticfed keys {command}: error: {message}", file=sys.stderr)
    return 2


def _need(command: str, **values: str) -> str | None:
    for flag, value in values.items():
        if not value:
            return f"--{flag.replace('_', '-')} is required"
    return None


def init(args: argparse.Namespace, config: KeysInitConfig) -> int:
    missing = _need("init", keys_dir=config.keys_dir)
    if missing:
        return _fail("init", missing)
    try:
        public = KeyFolder(config.keys_dir).init(force=config.force)
    except (KeyFileError, OSError) as exc:
        return _fail("init", str(exc))
    print(f"gateway key folder ready: {config.keys_dir}")
    print(f"give every device the gateway's public key: {public}")
    print(f"public key: {read_key_file(public).public.decode()}")
    return 0


def generate_pair(args: argparse.Namespace, config: KeysGenerateConfig) -> int:
    missing = _need("generate", name=config.name)
    if missing:
        return _fail("generate", missing)
    try:
        public, secret = generate(config.name, config.out_dir, force=config.force)
    except (KeyFileError, OSError) as exc:
        return _fail("generate", str(exc))
    print(f"secret key (keep on the device, mode 0600): {secret}")
    print(f"public key (enrol it on the gateway): {public}")
    print(f"public key: {read_key_file(public).public.decode()}")
    return 0


def enrol(args: argparse.Namespace, config: KeysEnrolConfig) -> int:
    missing = _need("enrol", keys_dir=config.keys_dir, public_key=config.public_key)
    if missing:
        return _fail("enrol", missing)
    try:
        name = config.name or read_key_file(config.public_key).name
        if not name:
            return _fail("enrol", f"{config.public_key} names no device; pass --name")
        path = KeyFolder(config.keys_dir).enrol(name, config.public_key, force=config.force)
    except (KeyFileError, OSError) as exc:
        return _fail("enrol", str(exc))
    print(f"enrolled {name}: {path}")
    return 0


def revoke(args: argparse.Namespace, config: KeysRevokeConfig) -> int:
    missing = _need("revoke", keys_dir=config.keys_dir, name=config.name)
    if missing:
        return _fail("revoke", missing)
    try:
        path = KeyFolder(config.keys_dir).revoke(config.name)
    except (KeyFileError, OSError) as exc:
        return _fail("revoke", str(exc))
    print(f"revoked {config.name} (kept as {path}); a running gateway refuses it within a second")
    return 0


def list_devices(args: argparse.Namespace, config: KeysListConfig) -> int:
    missing = _need("list", keys_dir=config.keys_dir)
    if missing:
        return _fail("list", missing)
    try:
        entries = KeyFolder(config.keys_dir).entries()
    except (KeyFileError, OSError) as exc:
        return _fail("list", str(exc))
    for e in entries:
        since = datetime.datetime.fromtimestamp(e.since, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        if config.json:
            print(json.dumps({"name": e.name, "status": e.status, "public_key": e.public, "since": e.since}))
        else:
            print(f"{e.name:<24} {e.status:<9} {since} UTC  {e.public}")
    if not entries and not config.json:
        print("no devices enrolled")
    return 0
