"""Files only this account may read.

What the service keeps on disk is as sensitive as what it serves: a KV block is the prompt (a
300-token chat and its system prompt come back exactly from layer 0 of one block), weights may
be a private fine-tune, and the node key, secret and API key files are credentials. So every
long-running process starts with a umask of 077 (new files 0600, new folders 0700, whatever
code writes them), and tightens what an older version left readable by others in its home.
What holds a user's data or a secret is written 0600 by its own code as well (`write_private`,
`private_opener`, the KV tier's and the weight store's explicit modes), so it stays private in a
process that did not start through the CLI. Files a user hands in (--secret-file,
--api-key-file) are refused when others can read them.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
_SHOWN = 3  # fixed paths a log line names; the rest are counted


class PrivateFileError(ValueError):
    """A file that must be private cannot be read, is readable by others, or is empty."""


def read_private(path: Path, what: str) -> str:
    """The stripped text of `path`, a file holding a `what` (a secret, API keys) that only this
    account may read; PrivateFileError says what is wrong and how to fix it."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise PrivateFileError(f"cannot read the {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PrivateFileError(f"the {what} file {path} is not UTF-8 text") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PrivateFileError(f"the {what} file {path} is readable by other users "
                               f"(mode {stat.S_IMODE(mode):o}): `chmod 600 {path}`")
    if not text:
        raise PrivateFileError(f"the {what} file {path} is empty")
    return text


def private_opener(path: str, flags: int) -> int:
    """`open(path, mode, opener=private_opener)`: a file it creates is 0600 whatever the umask
    (one that exists keeps its mode)."""
    return os.open(path, flags, 0o600)


def write_private(path: Path, data: str | bytes, durable: bool = False) -> None:
    """Replaces `path` with `data` atomically (a process killed meanwhile leaves the old file or
    the new one, never half of one), mode 0600 from its first byte in a folder made 0700:
    private whatever the process's umask, since a chmod after the write would leave it readable
    meanwhile. `durable`: on disk before it replaces the old one, a machine's crash included (an
    fsync, which may block for a while on a slow disk). Its temporary file is its own (other
    writers, threads included, use theirs)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def tighten(root: Path) -> list[tuple[Path, int]]:
    """Takes the group and other bits off `root` and everything under it, never following a
    link (a model folder linked into the store is the user's, not ours to change). Returns what
    it changed, each with its old mode; what cannot be changed (another account's) is left."""
    fixed: list[tuple[Path, int]] = []

    def fix(path: str, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if mode & PRIVATE_UMASK:
            try:
                os.chmod(path, mode & ~PRIVATE_UMASK)
            except OSError:
                return
            fixed.append((Path(path), mode))

    try:
        st = os.lstat(root)
    except OSError:
        return fixed
    if stat.S_ISLNK(st.st_mode):
        return fixed
    fix(str(root), st)
    folders = [str(root)] if stat.S_ISDIR(st.st_mode) else []
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            fix(entry.path, st)
            if stat.S_ISDIR(st.st_mode):
                folders.append(entry.path)
    return fixed


def keep_private(*trees: Path | None) -> None:
    """Called first by every long-running process: the umask makes whatever it writes private,
    and `trees` (its home, a cache folder elsewhere) lose the looser modes an older version
    gave them, said in one log line. A tree holding the user's home folder is left alone: an
    OMLX_CLUSTER_HOME set to ~ must not turn ~/Public private."""
    os.umask(PRIVATE_UMASK)
    user_home = Path.home().resolve()
    for tree in trees:
        if tree is None:
            continue
        root = Path(tree).expanduser().resolve()
        if user_home.is_relative_to(root):
            log.warning("%s holds your home folder: its modes are left as they are (point "
                        "OMLX_CLUSTER_HOME or the cache folder at a folder of its own)", root)
            continue
        fixed = tighten(root)
        if fixed:
            shown = ", ".join(f"{p} ({m:o})" for p, m in fixed[:_SHOWN])
            more = f" and {len(fixed) - _SHOWN} more" if len(fixed) > _SHOWN else ""
            log.warning("made %d of the files and folders under %s private (files 0600, "
                        "folders 0700): older versions left them readable by other accounts: "
                        "%s%s", len(fixed), root, shown, more)
