"""Running an office cluster: `doctor`, `up`, `down` and `link-probe` over SSH, and `secret
new`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omlx_cluster.client import client_api_key


def _hosts(args: argparse.Namespace) -> list[str]:
    from omlx_cluster.doctor import read_hosts_file

    try:
        listed = read_hosts_file(args.hosts_file) if args.hosts_file else []
    except OSError as e:
        print(f"error: cannot read the hosts file {args.hosts_file}: {e.strerror}",
              file=sys.stderr)
        raise SystemExit(2) from None
    return list(dict.fromkeys([*args.hosts, *listed]))  # once each, in the order given


def doctor_command(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from rich.console import Console

    from omlx_cluster import doctor
    from omlx_shared.auth import SecretError, secret_from
    from omlx_shared.checks import REMOTE_ONLY
    from omlx_shared.model_spec import resolve_model
    from omlx_shared.model_store import ModelError

    try:
        secret = secret_from(None, args.secret_file) if args.secret_file else None
        model = resolve_model(args.model, progress=True) if args.model else None
    except (SecretError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = doctor.DoctorOptions(
        timeout=args.timeout, ssh_config=args.ssh_config, remote_command=args.remote_command,
        secret=secret, secret_file=args.secret_file, model=model,
        only=set(args.check) if args.check else None, grpc_port=args.node_port,
        metrics_port=args.metrics_port, probe_port=args.probe_port)
    hosts = _hosts(args)
    if not hosts and (remote := [c for c in args.check or [] if c in REMOTE_ONLY]):
        print(f"error: --check {', '.join(remote)} compare Macs or look at them from another "
              "machine: name the hosts (doctor HOST ... or --hosts-file FILE)", file=sys.stderr)
        return 2
    diagnosis = (asyncio.run(doctor.diagnose(hosts, options)) if hosts
                 else doctor.check_here(options))
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        doctor.render(diagnosis, Console())
    return 1 if diagnosis.failed else 0


def _step_printer():
    """Prints each step of `up` / `down` as it ends: host, step, outcome, detail."""
    from rich.console import Console
    from rich.text import Text

    console = Console()
    styles = {"done": "green", "unchanged": "dim", "failed": "bold red", "skipped": "yellow",
              "waiting": "cyan"}

    def report(host: str, step: str, outcome: str, detail: str) -> None:
        console.print(Text.assemble(f"{host}  {step:<9}", (f"{outcome:<10}", styles[outcome]),
                                    detail), soft_wrap=True)

    return report


def up_command(args: argparse.Namespace) -> int:
    import asyncio

    from omlx_cluster import provision
    from omlx_shared.auth import SecretError

    hosts = _hosts(args)
    if not hosts:
        print("error: name the hosts to bring up (HOST ... or --hosts-file)", file=sys.stderr)
        return 2
    if not provision.TEMPLATE.exists():
        print(f"error: the launchd job's template {provision.TEMPLATE} is missing: run up from "
              "a checkout of omlx-cluster (pip install -e)", file=sys.stderr)
        return 2
    try:
        secret = _up_secret(args.secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    key = client_api_key(args)
    options = provision.UpOptions(
        secret=secret, coordinator=args.coordinator, api_key=key,
        remote_command=args.remote_command, node_port=args.node_port,
        metrics_port=args.metrics_port, wait=args.wait, timeout=args.timeout,
        ssh_config=args.ssh_config)
    return 0 if asyncio.run(provision.up(hosts, options, _step_printer())) else 1


def _up_secret(path: Path | None) -> str:
    """--secret-file's secret; without one, the secret in $OMLX_CLUSTER_HOME/secret, made there
    the first time (so a second `up` finds the same one and changes nothing)."""
    from omlx_shared.auth import new_secret, secret_from, write_secret
    from omlx_shared.model_store import data_home

    if path is None and not (path := data_home() / "secret").exists():
        write_secret(path, new_secret())
        print(f"made a new cluster secret in {path} (mode 0600): start the coordinator with "
              f"--secret-file {path}", file=sys.stderr)
    return secret_from(None, path)


def down_command(args: argparse.Namespace) -> int:
    import asyncio

    from omlx_cluster import provision

    hosts = _hosts(args)
    if not hosts:
        print("error: name the hosts to take down (HOST ... or --hosts-file)", file=sys.stderr)
        return 2
    done = asyncio.run(provision.down(hosts, args.timeout, args.ssh_config, _step_printer()))
    return 0 if done else 1


def link_probe_command(args: argparse.Namespace) -> int:
    import json

    from omlx_shared.link_probe import ProbeError, run_rank

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if len(peers) != 2:
        print(f"error: --peers takes two HOST:PORT, got {args.peers!r}", file=sys.stderr)
        return 2
    try:
        measured = run_rank(args.rank, peers, nbytes=args.bytes, timeout=args.timeout)
    except ProbeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(measured.to_dict() if measured else {}))
    elif measured:
        print(f"{measured.gb_per_s:.2f} GB/s, {measured.latency_us:.0f} µs one way "
              f"({measured.nbytes >> 20} MiB messages between {peers[0]} and {peers[1]})")
    else:
        print(f"rank 1 done (rank 0 on {peers[0]} prints the measurement)")
    return 0


def secret_command(args: argparse.Namespace) -> int:
    from omlx_shared.auth import SecretError, new_secret, write_secret

    secret = new_secret()
    if args.file is None:
        print(secret)
        return 0
    try:
        write_secret(args.file, secret, overwrite=args.force)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a new cluster secret to {args.file} (mode 0600): pass --secret-file "
          f"{args.file}", file=sys.stderr)
    return 0
