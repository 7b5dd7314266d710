"""`omnirail up` and `down`, and how a process the launcher started ends.

`up` starts a mesh (`omnirail.ops.launcher.Mesh`) and serves it until SIGTERM or SIGINT,
then stops it; `up --detach` starts that in the background and returns once it is ready;
`down` sends a detached mesh's launcher SIGTERM and waits for it to exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from omnirail.cli.args import progress
from omnirail.cli.security import mesh_argv, mesh_env
from omnirail.config import load_pipeline


def cmd_up(args: argparse.Namespace) -> int:
    """Serves the mesh until SIGTERM or SIGINT (`--detach`: in the background)."""
    if args.detach:
        return _up_detached(args)
    code = _up_attached(args)
    # The launcher imported every stage's module (torch among them) when it validated the
    # pipeline; its mesh is stopped and its state file gone, so it ends as its service
    # processes do, without the interpreter's teardown (0.7 s of a 1.6 s `down` on 2 cores).
    exit_now(code)
    return code


def _up_attached(args: argparse.Namespace) -> int:
    from omnirail.ops.control import serve_pending
    from omnirail.ops.launcher import Mesh, read_states, write_state

    mesh = Mesh(
        args.file,
        transport="tcp" if args.tcp else None,
        host=args.host,
        port=args.port,
        run_dir=args.run_dir,
        progress=progress(args.quiet),
        pin=args.pin,
        cpu_wake_latency_us=args.cpu_wake_latency_us,
        env=mesh_env(args),
        tls=args.tls,
        http=args.http,
    )
    name = args.name or mesh.pipeline.name or "pipeline"
    if name in read_states():
        raise ValueError(f"a mesh named {name!r} is already running; `omnirail down --name {name}`")
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    woken = _signal_pipe()
    state = None
    try:
        address = mesh.start()
        state = write_state(
            name,
            {
                "pid": os.getpid(),
                "address": address,
                "pipeline": mesh.pipeline_path,
                "run_dir": str(mesh.run_dir),
                "http": mesh.http_address,
                # How clients reach it: paths only (the CA, where tokens are), no secrets.
                "security": mesh.client_state(),
            },
        )
        print(address, flush=True)
        while not stop:
            # `omnirail restart` and other commands from the run directory.
            serve_pending(mesh.run_dir, mesh.handle_control)
            # Stage processes restart on their own (or stay down past their budget while
            # the rest serves); the coordinator's exit ends the mesh.
            exited = mesh.poll_exited()
            if exited:
                for who, code in exited:
                    print(f"[omnirail] {who} exited with code {code}; stopping", file=sys.stderr)
                return 1
            _wait(woken, 0.2)
        return 0
    finally:
        progress(args.quiet)("stopping")
        t0 = time.monotonic()
        exits = mesh.stop()
        bad = {who: code for who, code in exits.items() if code != 0}
        codes = f"exit codes other than 0: {bad}" if bad else f"all {len(exits)} processes exited 0"
        # Always said (also under --quiet: a detached mesh's log keeps it).
        print(
            f"[omnirail] stopped in {time.monotonic() - t0:.2f}s; {codes}",
            file=sys.stderr,
            flush=True,
        )
        if state is not None:
            state.unlink(missing_ok=True)


def _signal_pipe() -> int:
    """A pipe's read end that becomes readable when a signal arrives (`set_wakeup_fd`),
    so that the serving loop wakes at once rather than at its next tick."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    return read


def _wait(woken: int, timeout: float) -> None:
    """Up to `timeout` seconds, less when a signal arrived; empties the pipe."""
    if select.select([woken], [], [], timeout)[0]:
        try:
            os.read(woken, 512)
        except BlockingIOError:
            pass


def _up_detached(args: argparse.Namespace) -> int:
    from omnirail.ops.launcher import read_states, state_dir

    cfg = load_pipeline(args.file)
    name = args.name or cfg.name or "pipeline"
    if name in read_states():
        raise ValueError(f"a mesh named {name!r} is already running; `omnirail down --name {name}`")
    log = state_dir() / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "omnirail",
        "up",
        str(Path(args.file).resolve()),
        "--name",
        name,
        "--quiet",
    ]
    if args.tcp:
        argv += ["--tcp", "--host", args.host or "127.0.0.1", "--port", str(args.port)]
    if args.run_dir:
        argv += ["--run-dir", args.run_dir]
    if args.http:
        argv += ["--http", args.http]
    if args.pin:
        argv.append("--pin")
    if args.cpu_wake_latency_us is not None:
        argv += ["--cpu-wake-latency-us", str(args.cpu_wake_latency_us)]
    argv += mesh_argv(args)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = read_states().get(name)
        if state is not None:
            print(state["address"])
            return 0
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-20:]
            print("\n".join(tail), file=sys.stderr)
            return 1
        time.sleep(0.1)
    proc.terminate()
    print(f"mesh {name!r} did not become ready; see {log}", file=sys.stderr)
    return 1


def cmd_down(args: argparse.Namespace) -> int:
    from omnirail.ops.launcher import running_meshes, terminate

    states = running_meshes(args.name)
    if args.name:
        names = [args.name]
    elif len(states) == 1 or (args.all and states):
        names = sorted(states)
    elif not states:
        print("no mesh is running", file=sys.stderr)
        return 0
    else:
        raise ValueError(f"several meshes are running ({sorted(states)}); pass --name or --all")
    failed = 0
    for name in names:
        pid = int(states[name]["pid"])  # type: ignore[arg-type]
        if not terminate(pid, 30):
            print(f"mesh {name!r} (pid {pid}) did not stop within 30 s", file=sys.stderr)
            failed += 1
        else:
            print(f"stopped {name}")
    return 1 if failed else 0


def exit_now(code: int) -> None:
    """Ends a service process that has shut down cleanly (its relays closed, segments
    unlinked, spans exported) without the interpreter's teardown: tearing down torch,
    grpc and their threads costs 0.3-0.5 s of CPU per process, which made stopping the
    8-process omni demo on 2 cores take 3 s. Logs and std streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
