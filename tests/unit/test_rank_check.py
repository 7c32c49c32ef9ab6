"""Every rank runs the same toggles, or every rank stops at once with the same clear error.

Multi-process tests use gloo on this CPU machine, through the same hook a Megatron run uses: the
plugin's post-parse step arms the check, and ``torch.distributed.init_process_group`` runs it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest

from megatron_perf_toggles.runtime.rank_check import describe_mismatch, fingerprint

torch = pytest.importorskip("torch", reason="torch is not installed: multi-rank checks need torch.distributed")

JOIN_TIMEOUT_S = 120


def _entry(rank, host, **toggles):
    base = {"grad_reduce_in_bf16": True, "ddp_average_in_collective": True}
    return {"rank": rank, "host": host, "fp": fingerprint({**base, **toggles}, {"te_version": "2.20"}, "apex")}


def test_equal_fingerprints_pass():
    assert describe_mismatch([_entry(r, "node0") for r in range(4)]) is None


def test_mismatch_names_toggle_values_ranks_hosts_and_env_var():
    entries = [_entry(0, "node0"), _entry(1, "node0"), _entry(2, "node1", grad_reduce_in_bf16=False),
               _entry(3, "node1", grad_reduce_in_bf16=False)]
    msg = describe_mismatch(entries)
    assert "grad_reduce_in_bf16: true on ranks 0-1 (node0) vs false on ranks 2-3 (node1)" in msg
    assert "GRAD_REDUCE_IN_BF16" in msg and "ddp_average_in_collective" not in msg


def test_capability_mismatch_is_reported():
    a, b = _entry(0, "n0"), _entry(1, "n1")
    b["fp"]["capabilities"]["te_version"] = "2.8"
    msg = describe_mismatch([a, b])
    assert "te_version" in msg and "install the same packages" in msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, environ, direct, queue, release):
    try:
        _rank(rank, world, port, environ, direct, queue)
    finally:
        # Rank 0 serves the rendezvous store: no rank leaves before every rank has reported, or a
        # rank still inside init_process_group loses the store ("Connection reset by peer").
        release.wait(timeout=JOIN_TIMEOUT_S)


def _rank(rank, world, port, environ, direct, queue):
    import datetime

    os.environ.update(environ)
    os.environ["RANK"] = str(rank)
    start = time.monotonic()
    try:
        import torch.distributed as dist

        from megatron_perf_toggles.runtime import provider
        from megatron_perf_toggles.tools.surfaces import replay

        parser = replay.parser_from_surface(replay.load_surface("main"))
        provider.attach(parser, environ={**environ, "RANK": str(rank)}, announce=False)
        parser.parse_args(["--bf16", "--position-embedding-type", "rope"])
        start = time.monotonic()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        if direct:
            import megatron_perf_toggles

            megatron_perf_toggles.check_ranks()
        queue.put((rank, "ok", "", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, type(exc).__name__, str(exc), time.monotonic() - start))


def _run(world, env_for_rank, direct=False):
    ctx = mp.get_context("fork")  # the parent already imported torch; forking skips re-importing it
    queue, release = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, env_for_rank(r), direct, queue, release))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, kind, msg, secs = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
                results[rank] = (kind, msg, secs)
            except Exception:  # noqa: BLE001 - queue.Empty: the deadline below reports it
                break
    finally:  # however the wait ends (an interrupted session too), the ranks may go
        release.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(results) == world, f"ranks did not all report within {JOIN_TIMEOUT_S}s: {results}"
    return results


BASE_ENV = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"}


@pytest.mark.parametrize("world", [2, 4])
def test_equal_envs_pass(world):
    results = _run(world, lambda r: dict(BASE_ENV))
    assert all(kind == "ok" for kind, _, _ in results.values()), results


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_with_another_env_fails_fast_everywhere(world):
    results = _run(world, lambda r: {**BASE_ENV, **({"GRAD_REDUCE_IN_BF16": "0"} if r == 1 else {})})
    messages = {msg for kind, msg, _ in results.values()}
    assert {kind for kind, _, _ in results.values()} == {"RankMismatchError"}
    assert len(messages) == 1  # the same message on every rank
    msg = messages.pop()
    assert "grad_reduce_in_bf16" in msg and "on ranks 1 " in msg and "GRAD_REDUCE_IN_BF16" in msg
    assert max(secs for _, _, secs in results.values()) < 30


def test_public_check_ranks_after_init():
    results = _run(2, lambda r: {**BASE_ENV, "MEGATRON_PERF_TOGGLES_RANK_CHECK": "0",
                                 **({"DDP_AVERAGE_IN_COLLECTIVE": "0"} if r == 0 else {})}, direct=True)
    assert {kind for kind, _, _ in results.values()} == {"RankMismatchError"}
    assert all("ddp_average_in_collective" in msg for _, msg, _ in results.values())


def test_opt_out_skips_the_automatic_check():
    results = _run(2, lambda r: {**BASE_ENV, "MEGATRON_PERF_TOGGLES_RANK_CHECK": "0",
                                 **({"GRAD_REDUCE_IN_BF16": "0"} if r == 1 else {})})
    assert all(kind == "ok" for kind, _, _ in results.values()), results


def test_opt_out_never_unwraps_torchs_own_function():
    import torch.distributed as dist

    from megatron_perf_toggles.runtime import rank_check

    rank_check.arm({"toggles": {}}, enabled=False)  # clears a wrapper left by an earlier parse here
    before = dist.init_process_group
    assert not getattr(before, "_perf_toggles_wrapped", False)
    rank_check.arm({"toggles": {}}, enabled=False)  # torch's own (decorated) function stays as it is
    assert dist.init_process_group is before
    rank_check.arm({"toggles": {}}, enabled=True)  # wraps (not initialised here)
    assert getattr(dist.init_process_group, "_perf_toggles_wrapped", False)
    rank_check.arm({"toggles": {}}, enabled=False)  # the opt-out removes only our wrapper
    assert dist.init_process_group is before
