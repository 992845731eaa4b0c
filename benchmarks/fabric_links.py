"""Real shaped links: collective times and kernel-counted bytes against the ring model.

    python benchmarks/fabric_links.py                        # 1 and 4 Gbit/s, 2x1 and 2x2, three ops, 64 MiB
    python benchmarks/fabric_links.py --gbit 1 --layouts 2x1 --ops all_reduce --mib 8

Each row launches gloo ranks inside a fresh labkit.fabric (needs root; prints the
mode and stops when fabric.probe() says the links would only be emulated). Framing
is measured, not assumed: the all-reduce row of each group gives wire bytes (what
the shapers charged) per payload byte (the ring model), and the predicted time of
every row in that group includes it. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse

from labkit import fabric
from labkit.launcher import launch
from labkit.topology import Topology, gbit_to_bytes_per_s, link_bytes_model, predicted_s

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def measure(topology: Topology, op: str, message_bytes: int, repeats: int) -> tuple[float, dict, dict]:
    """(slowest rank's best time, traffic per link over all calls, model payload per link over all calls)."""
    with fabric.Fabric(topology) as fab:
        before = fab.link_bytes()
        results = launch(fabric.collective_rank, fab.topology.world_size, fabric=fab, op=op, message_bytes=message_bytes, repeats=repeats)
        traffic = fabric.delta(before, fab.link_bytes())
    calls = repeats + 1
    payload = {link: nbytes * calls for link, nbytes in link_bytes_model(op, message_bytes, topology).items()}
    return max(result["best_s"] for result in results), traffic, payload


def group(gbit: float, nodes: int, ranks_per_node: int, ops: list[str], message_bytes: int, repeats: int) -> None:
    topology = Topology(nodes=nodes, ranks_per_node=ranks_per_node, inter_node_bytes_per_s=gbit_to_bytes_per_s(gbit))
    wire_per_payload = None
    for op in sorted(ops, key=lambda name: name != "all_reduce"):
        measured_s, traffic, payload = measure(topology, op, message_bytes, repeats)
        wire_per_payload = wire_per_payload or fabric.framing(traffic, payload)
        busiest = max(payload, key=payload.get)
        bare_s = predicted_s(op, message_bytes, topology)
        framed_s = bare_s * wire_per_payload
        counted, wire = (getattr(traffic[busiest], name) / payload[busiest] for name in ("tx_payload_bytes", "tx_wire_bytes"))
        print(f"{gbit:>5g} {nodes}x{ranks_per_node:<3} {op:>14} {message_bytes / 2**20:>5.0f} "
              f"{measured_s * 1e3:>8.0f} {bare_s * 1e3:>8.0f} {framed_s * 1e3:>9.0f} {measured_s / framed_s:>6.2f} "
              f"{counted:>10.4f} {wire:>9.4f}")
    print(f"      framing measured on the all-reduce: {wire_per_payload:.4f} wire bytes per payload byte")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gbit", type=float, nargs="+", default=[1.0, 4.0], help="link rates, Gbit/s each way")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], help="NODESxRANKS_PER_NODE")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--mib", type=int, default=64, help="message size in MiB (fp32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up; best is kept")
    args = parser.parse_args()
    capability = fabric.probe()
    print(f"links: {capability.mode} ({capability.reason})")
    if capability.mode != "namespaces":
        raise SystemExit("real links need network namespaces; see labkit.fabric")
    print(f"{'Gbit':>5} {'layout':<5} {'op':>14} {'MiB':>5} {'meas ms':>8} {'pred ms':>8} "
          f"{'+framing':>9} {'ratio':>6} {'count/ring':>10} {'wire/ring':>9}")
    for gbit in args.gbit:
        for layout in args.layouts:
            nodes, ranks_per_node = (int(part) for part in layout.split("x"))
            group(gbit, nodes, ranks_per_node, args.ops, args.mib * 2**20, args.repeats)


if __name__ == "__main__":
    main()
