"""Bearer tokens for the agent's write endpoints.

Configured with VLLM_RUNBOOK_TOKEN or VLLM_RUNBOOK_TOKEN_FILE; otherwise the
agent makes one at start and stores it, mode 0600, in a private runtime
directory where the `runbook` CLI finds it for a local engine. Tokens are
compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path


class TokenError(Exception):
    pass


def runtime_dir() -> Path:
    """Private per-user directory for generated tokens."""
    base = os.environ.get("VLLM_RUNBOOK_RUNTIME_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "vllm-runbook"
    return Path("/tmp") / f"vllm-runbook-{os.getuid()}"


def token_path(port: int, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"agent-{port}.token"


def _private_dir(directory: Path) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise TokenError(f"{directory} is not a directory owned by this user")
    if info.st_mode & 0o077:
        raise TokenError(
            f"{directory} is accessible by other users (mode {info.st_mode & 0o777:o})"
        )
    return directory


def configured_token(env: dict[str, str] | None = None) -> str | None:
    env = dict(os.environ) if env is None else env
    token = env.get("VLLM_RUNBOOK_TOKEN", "").strip()
    if token:
        return token
    path = env.get("VLLM_RUNBOOK_TOKEN_FILE", "").strip()
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read VLLM_RUNBOOK_TOKEN_FILE: {exc.strerror}") from None
        if not token:
            raise TokenError("VLLM_RUNBOOK_TOKEN_FILE is empty")
        return token
    return None


def generate_token(port: int, directory: Path | None = None) -> tuple[str, Path]:
    """A fresh token, written 0600 to the runtime directory for the CLI."""
    token = secrets.token_urlsafe(32)
    path = token_path(port, _private_dir(directory or runtime_dir()))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")
    return token, path


def find_local_token(port: int, directory: Path | None = None) -> str | None:
    """The generated token of a local agent on `port`, if readable."""
    try:
        return token_path(port, directory).read_text().strip() or None
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bearer(header: str | None, token: str) -> bool:
    """Constant-time check of an `Authorization: Bearer …` header."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())
