"""Two checkouts, one machine: run a benchmark in each, alternated back to back, and print the
new/old ratio of every figure.

A refactor that promises "no behaviour change" must also change no speed. Host speed drifts over
minutes on a shared GPU host, so the runs alternate (old, new, old, new, ...) and each figure's
ratio is the median of the new runs over the median of the old runs.

    python benchmarks/ab_compare.py --old /path/to/old --new . --rounds 2 -- \
        benchmarks/grammar_overlap.py --device cuda --batch 1 32 64 --algorithms ngram --overlap on

The command after ``--`` runs with ``cwd`` and ``PYTHONPATH`` set to each checkout. Figures are
read from its summary lines: ``grammar_overlap`` lines give ``step_ms_no_grammar`` and
``step_ms_json_schema`` per ``(algo, overlap, bs)``; ``host_overhead`` lines give ``host_ms``,
``step_ms``, ``verify_ms`` and ``tok/s`` per ``(algo, grammar, bs)``; ``peer_compare`` rows give
``tok/s`` per row name and batch. One line per figure: ``ab_compare <figure> old=<median> new=<median>
ratio=<new/old>`` (for step times lower is better, for tok/s higher is better).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

_OVERLAP_KEYS = ("algo", "overlap", "bs")
_OVERLAP_FIGURES = ("step_ms_no_grammar", "step_ms_json_schema")
_HOST_KEYS = ("algo", "grammar", "bs")
_HOST_FIGURES = ("host_ms", "step_ms", "verify_ms", "tok/s")
_PEER_ROW = re.compile(r"^(structspec [\w+]+|hf_generate\S*)\s+bs=(\d+)\s+tok/s=\s*([\d.]+)")


def figures(output: str) -> dict[str, float]:
    """The figures of one benchmark run's stdout, keyed ``"<config> <figure>"``.

    Args:
        output: the text the benchmark printed.

    Returns:
        One float per figure found (empty when the output has no summary line).
    """
    out: dict[str, float] = {}
    for line in output.splitlines():
        if line.startswith("grammar_overlap "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
            config = " ".join(f"{k}={fields[k]}" for k in _OVERLAP_KEYS)
            for name in _OVERLAP_FIGURES:
                out[f"{config} {name}"] = float(fields[name])
        elif line.startswith("host_overhead "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
            config = " ".join(f"{k}={fields[k]}" for k in _HOST_KEYS)
            for name in _HOST_FIGURES:
                out[f"{config} {name}"] = float(fields[name])
        elif m := _PEER_ROW.match(line):
            out[f"{m.group(1)} bs={m.group(2)} tok/s"] = float(m.group(3))
    return out


def run_once(checkout: Path, command: list[str], timeout_s: float) -> dict[str, float]:
    """Run ``python <command>`` in ``checkout`` and parse its figures.

    Raises:
        RuntimeError: the command failed or printed no figure (its output tail is included).
    """
    env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, *command], cwd=checkout, env=env, text=True,
                          capture_output=True, timeout=timeout_s)
    found = figures(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{checkout}: exit {proc.returncode}, {len(found)} figures\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the old checkout's root")
    ap.add_argument("--new", type=Path, required=True, help="the new checkout's root")
    ap.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternated")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit for one run")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- then the benchmark script and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark command after --")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in ("old", "new"):
            root = (args.old if side == "old" else args.new).resolve()
            found = run_once(root, command, args.timeout_s)
            runs[side].append(found)
            # each run's figures at once: a run cut short by a time limit keeps what it had
            print(f"# round {r + 1} {side} " + " ".join(
                f"{k.replace(' ', ':')}={v:.3f}" for k, v in found.items()), flush=True)
    for key in runs["new"][0]:
        old = statistics.median(f[key] for f in runs["old"] if key in f)
        new = statistics.median(f[key] for f in runs["new"] if key in f)
        print(f"ab_compare {key} old={old:.3f} new={new:.3f} ratio={new / old:.3f} "
              f"rounds={args.rounds}", flush=True)


if __name__ == "__main__":
    main()
