"""The ``labkit`` command: run the course headlessly, check the machine, build ops."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labkit.profiles import PROFILE_NAMES


def _run(args: argparse.Namespace) -> int:
    from labkit.course import select
    from labkit.runner import run_labs

    try:
        labs = select(args.labs)
        runs = run_labs(labs, Path(args.out), profile=args.profile)
    except ValueError as exc:
        print(f"labkit run: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        print(f"lab {run.lab.number} {run.lab.slug}: {'passed' if run.passed else 'FAILED'} ({run.seconds:.0f} s)")
    print(f"report: {Path(args.out) / 'report.md'} and report.html")
    return 0 if all(run.passed for run in runs) else 1


def _doctor(args: argparse.Namespace) -> int:
    from labkit.doctor import checks, print_checks

    found = checks()
    print_checks(found)
    return 0


def _ops(args: argparse.Namespace) -> int:
    from labkit import dsops

    for name, seconds in dsops.ensure_built(tuple(args.ops)).items():
        print(f"{name}: ready ({seconds:.1f} s)")
    return 0


def _profile_name(value: str) -> str:
    if value not in PROFILE_NAMES:
        raise argparse.ArgumentTypeError(f"profile must be one of {PROFILE_NAMES}, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute labs headlessly and write a report")
    run.add_argument("labs", nargs="*", default=["all"], help="lab numbers or slugs, or 'all' (default)")
    run.add_argument("--profile", type=_profile_name, default=None, help=f"one of {PROFILE_NAMES}")
    run.add_argument("--out", default="runs/latest", help="folder for executed notebooks, figures, report")
    run.set_defaults(func=_run)
    doctor = sub.add_parser("doctor", help="what this machine offers for the labs")
    doctor.set_defaults(func=_doctor)
    ops = sub.add_parser("build-ops", help="build DeepSpeed's JIT ops into this environment")
    ops.add_argument("ops", nargs="*", default=["ShareMemCommBuilder", "CPUAdamBuilder"])
    ops.set_defaults(func=_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
