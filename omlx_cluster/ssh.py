"""SSH to the Macs of the cluster (asyncssh), for `doctor`, `up` and `down`.

A connection is made as `ssh HOST` would make it: the user's ~/.ssh/config (or `--ssh-config`)
names the host, user, port, keys and known_hosts; the agent and the default keys are offered;
the host key must be known. What fails is said in one sentence with what to do, never as a
traceback. Every remote command runs under `sh -c`, so it is POSIX sh whatever the user's login
shell (zsh on a Mac).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import socket
import warnings
from pathlib import Path

# asyncssh still imports cryptography's DSA, which warns about it ten times at import (before
# doctor's table, up's or down's steps): a warning to asyncssh's authors, not to our users.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    import asyncssh

from omlx_shared.checks import Output

asyncssh.set_log_level(logging.WARNING)  # a line per channel opened: noise for people


class SshError(RuntimeError):
    """A host that cannot be reached or logged into; the message says why and what to do."""


def parse_target(spec: str) -> tuple[str | None, str, int | None]:
    """"[user@]host[:port]" (an IPv6 host in brackets) -> (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, text = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        text = tail[1:] if tail.startswith(":") else None
    elif rest.count(":") == 1:
        host, _, text = rest.partition(":")
    port = None
    if text is not None:
        if not (text.isdigit() and 0 < int(text) <= 65535):
            raise SshError(f"{spec}: the SSH port {text!r} is not a port number (1 to 65535); "
                           "write the host as [user@]host[:port]")
        port = int(text)
    return user or None, host, port


class Remote:
    """One logged-in SSH connection to a host."""

    def __init__(self, name: str, conn: asyncssh.SSHClientConnection):
        self.name = name
        self.conn = conn
        # The address SSH reached: the one the other Macs and the coordinator dial for this
        # node too (its `join --host`, its data plane).
        self.address: str = conn.get_extra_info("peername")[0]
        self.local_address: str = conn.get_extra_info("sockname")[0]

    async def run(self, command: str, timeout: float = 60.0, input: str | None = None) -> Output:
        """Runs `command` under sh; a timeout or a refused channel is an Output (124 / 255)."""
        try:
            done = await self.conn.run(f"sh -c {shlex.quote(command)}", check=False,
                                       timeout=timeout, input=input)
        except asyncssh.TimeoutError as e:
            return Output(124, str(e.stdout or ""), f"no answer within {timeout:.0f} s")
        except asyncssh.Error as e:
            return Output(255, "", f"SSH: {e.reason}")
        # A command killed by a signal has no exit status: say so like a shell does.
        code = done.exit_status if done.exit_status is not None else 128
        return Output(code, str(done.stdout or ""), str(done.stderr or ""))

    async def close(self) -> None:
        self.conn.close()
        await self.conn.wait_closed()


async def connect(spec: str, timeout: float, config: Path | None = None) -> Remote:
    """Logs into `spec` ("[user@]host[:port]" or a Host of the SSH config) within `timeout`
    seconds; raises SshError saying why not."""
    user, host, port = parse_target(spec)
    try:
        conn = await asyncssh.connect(
            host, port=port if port is not None else (), username=user or (),
            config=[str(config)] if config else (), connect_timeout=timeout)
    except asyncssh.PermissionDenied:
        raise SshError(f"{spec}: SSH refused every key offered (permission denied): put your "
                       f"public key in ~/.ssh/authorized_keys there (`ssh-copy-id {spec}`), or "
                       "name the right one with IdentityFile in ~/.ssh/config") from None
    except asyncssh.HostKeyNotVerifiable as e:
        raise SshError(f"{spec}: its host key is not trusted here ({e.reason}): `ssh {spec}` "
                       "once to check and accept it") from None
    except asyncssh.Error as e:
        raise SshError(f"{spec}: SSH failed: {e.reason}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise SshError(f"{spec}: no SSH answer within {timeout:.0f} s (is the Mac awake, on "
                       "this network, with Remote Login on?)") from None
    except ConnectionRefusedError:
        raise SshError(f"{spec}: connection refused: nothing listens for SSH there (System "
                       "Settings > General > Sharing > Remote Login)") from None
    except socket.gaierror as e:
        raise SshError(f"{spec}: cannot resolve {host}: {e.strerror}") from None
    except OSError as e:
        raise SshError(f"{spec}: cannot connect: {e.strerror or e}") from None
    return Remote(spec, conn)
