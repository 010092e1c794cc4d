"""The soak's growth measure (bench/soak_report.py `steady`): restarts are not growth, a
process that grows steadily is, whatever restarts happen around it."""

from __future__ import annotations

from bench.soak_report import LONG_LIVED, SAMPLE_EVERY, WARM_UP, steady

MIB = 2**20


def run(seconds: float, rss_of, loaded=lambda pid, t: False) -> list[dict]:
    """Samples as the soak's sampler writes them: `rss_of(t)` -> {pid: (role, rss)};
    `loaded(pid, t)`: whether the worker exports its gauges (holds a shard)."""
    out = []
    t = 0.0
    while t <= seconds:
        procs = {str(pid): [role, rss, 10, 20] for pid, (role, rss) in rss_of(t).items()}
        stages = {pid: {"mlx_active": MIB} for pid in procs if loaded(int(pid), t)}
        s = {"t": t, "procs": procs, "stages": stages}
        for role in {r for r, *_ in procs.values()}:
            mine = [p for p in procs.values() if p[0] == role]
            s[role] = {"rss": sum(p[1] for p in mine), "fds": 10 * len(mine),
                       "threads": 20 * len(mine), "procs": len(mine)}
        out.append(s)
        t += SAMPLE_EVERY
    return out


def test_a_restart_at_the_end_is_not_growth():
    """A worker killed late comes back lighter and warms again: the start/end snapshot the
    soak used to print read that as -30%; the medians of the thirds read nothing."""
    end = WARM_UP + 3 * LONG_LIVED

    def rss_of(t: float) -> dict:
        if t < end - 60:
            return {1: ("workers a", 150 * MIB)}
        return {2: ("workers a", (100 + min(50, t - (end - 60))) * MIB)}

    g = steady(run(end, rss_of))
    assert abs(g["roles"]["workers a"]["rss"]["pct"]) < 1
    (whole,) = g["processes"]  # the fresh one lived too short to be judged alone
    assert whole["pid"] == 1 and whole["rss"]["pct"] == 0


def test_a_process_that_grows_steadily_is_growth():
    """One process gaining 1 MiB a minute among others that restart: flagged on its own."""
    end = WARM_UP + 3 * LONG_LIVED

    def rss_of(t: float) -> dict:
        restarted = 10 + int(t // 120)  # a new pid every two minutes
        return {1: ("agent a", (80 + t / 60) * MIB), restarted: ("workers a", 150 * MIB)}

    g = steady(run(end, rss_of))
    (agent,) = [e for e in g["processes"] if e["role"] == "agent a"]
    assert agent["whole"] and agent["rss"]["pct"] > 5
    assert 55 < agent["rss_mib_per_hour"] < 65
    assert not [e for e in g["processes"] if e["role"] == "workers a"]


def test_a_standby_worker_taking_a_shard_is_not_growth():
    """The agent's standby worker (no shard) is lighter; taking a shard is its start."""
    end = WARM_UP + 3 * LONG_LIVED
    load_at = WARM_UP + 60

    def rss_of(t: float) -> dict:
        return {1: ("workers a", (104 if t < load_at else 150 + (t > load_at + 30)) * MIB)}

    g = steady(run(end, rss_of, lambda pid, t: t >= load_at))
    (worker,) = g["processes"]
    assert worker["from"] >= load_at + 60 and worker["rss"]["pct"] == 0
