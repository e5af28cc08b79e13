"""The peer system, spec-ptc (PyPI), run side by side with agentrt on the same programs.

spec-ptc needs Python >= 3.12, so it runs in a virtualenv of its own (``bash .ci/peer-venv.sh``
builds ``.venv-peer``; ``PEER_VENV`` names another one). `PeerDriver` starts
``benchmarks.peer_driver`` with that venv's Python and hands it one pattern at a time: the same
scripted responses cut into the same replay tokens (`agentrt.engine.replay.split_tokens`), the
same token rate and the same tools with the same latencies as agentrt's run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from agentrt.engine.replay import split_tokens

from .patterns import Pattern

PEER = "spec-ptc"
ROOT = Path(__file__).resolve().parents[1]


class PeerUnavailable(Exception):
    """The peer cannot run here (no virtualenv, or its driver does not start); says why."""


def peer_python(venv: str | Path | None = None) -> Path:
    """The peer virtualenv's Python; `PeerUnavailable` with what to do when it is missing."""
    where = Path(venv or os.environ.get("PEER_VENV") or ROOT / ".venv-peer")
    python = where / "bin" / "python"
    if not python.exists():
        raise PeerUnavailable(
            f"{PEER} was not run: its virtualenv {where} is missing. Build it with "
            "`bash .ci/peer-venv.sh` (needs Python >= 3.12), or set PEER_VENV.")
    return python


def job(pattern: Pattern, tokens_per_second: float, latency: float) -> dict[str, Any]:
    """What the driver needs to play ``pattern`` as agentrt's `ReplayEngine` does."""
    return {"pattern": pattern.name, "turns": [split_tokens(r) for r in pattern.responses],
            "tokens_per_second": tokens_per_second, "latency": latency,
            "tools": list(pattern.tools), "context": pattern.context}


def oolong_job(task_id: str, responses: list[str], context: str, tokens_per_second: float,
               sub_url: str, sub_model: str, sub_max_tokens: int | None = None) -> dict[str, Any]:
    """An OOLONG task in replay mode: the root streams ``responses``, one per turn;
    ``llm_query`` asks the sub-model at ``sub_url`` (the server root or its ``/v1`` URL)."""
    url = sub_url.rstrip("/")
    return {"pattern": task_id, "turns": [split_tokens(r) for r in responses],
            "tokens_per_second": tokens_per_second, "context": context,
            "sub_url": url if url.endswith("/v1") else f"{url}/v1", "sub_model": sub_model,
            "sub_max_tokens": sub_max_tokens}


class PeerDriver:
    """``with PeerDriver(python) as peer: peer.run(job(...))`` -- one driver process for a run."""

    def __init__(self, python: str | Path, *, own_harness: bool = False) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")
        command = [str(python), "-m", "benchmarks.peer_driver"]
        if own_harness:
            command.append("--own-harness")
        self._proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            ready = self._read()
        except PeerUnavailable:
            self.close()
            raise
        if not ready.get("ready"):
            self.close()
            raise PeerUnavailable(f"the {PEER} driver said {ready!r} instead of being ready")

    def run(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Run one job; its result (with ``"error"`` when the peer raised)."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(payload) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise PeerUnavailable(f"the {PEER} driver exited: {self._stderr_tail()}") from None
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=10)
            raise PeerUnavailable(f"the {PEER} driver exited ({self._proc.returncode}): "
                                  f"{self._stderr_tail()}")
        return json.loads(line)

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].strip() or "no output"

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> PeerDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.peer``: the peer on every pattern through this project's driver and
    through spec-ptc's own turn loop (``spec_ptc.Harness``), interleaved, with both wall times:
    the check that the driver costs the peer nothing."""
    import argparse

    from .patterns import patterns

    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=main.__doc__)
    parser.add_argument("--tokens-per-second", type=float, default=50.0)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--only", nargs="*", help="pattern names to run")
    args = parser.parse_args(argv)
    try:
        python = peer_python()
        drivers = PeerDriver(python), PeerDriver(python, own_harness=True)
    except PeerUnavailable as exc:
        print(f"error: {exc}")
        return 2
    print(f"| pattern | driver s | {PEER} Harness s | driver / Harness |\n|---|---|---|---|")
    ratios = []
    try:
        for p in patterns():
            if args.only and p.name not in args.only:
                continue
            ours, theirs = (d.run(job(p, args.tokens_per_second, args.latency)) for d in drivers)
            if "error" in ours or "error" in theirs:
                print(f"| {p.name} | {ours.get('error', '')} | {theirs.get('error', '')} | - |")
                continue
            ratios.append(ours["wall_s"] / theirs["wall_s"])
            print(f"| {p.name} | {ours['wall_s']:.2f} | {theirs['wall_s']:.2f} | "
                  f"{ratios[-1]:.2f} |", flush=True)
    finally:
        for d in drivers:
            d.close()
    if ratios:
        ratios.sort()
        print(f"\nmedian driver / Harness: {ratios[len(ratios) // 2]:.3f} over {len(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
