"""Non-IID data: what skewed sites cost the fleet, with the defaults a user gets, against FedAvg.

Digits, 8 edges (`elasticfed demo`'s harness: the gateway in this process, one
process per edge, CURVE on), 30% message loss each way in bursts (mean 3), on
two partitions that hurt (common/task.py): `dirichlet:0.1` (each label spread
over the sites by Dirichlet(0.1) shares: most sites hold one or two dominant
classes) and `shards` (two label-sorted slices per site).  Contenders, one run:

- defaults: `cloud serve`'s gateway settings and `elasticfed edge`'s local
  learning rate (the task's), nothing else set;
- best: the defaults plus `--best` (gateway settings and the edges' `prox_mu`, as
  key=value; the best option found, see the README);
- fedavg: synchronous FedAvg on the same partition (benchmarks/convergence.py:
  every round all clients, one local epoch of at most 50 steps, the model down
  and up over a link losing 30% of messages, retried every 100 ms);
- reference: the defaults, IID, no loss.

Every run reports each site's accuracy on its own held-out data: the test set
weighed by that site's training label mix (a site that holds only 3s and 8s is
judged on 3s and 8s).  With `--lm`, the same for the small stdlib text task: 4
edges split by top-level package against IID, both with the defaults and no
loss (bits per byte).  The figures are those of the model the gateway reports
at the end (after the edges' drain): the average of its last versions with the
defaults (cloud/ema.py), with the live model's beside it; one run each: on
digits (360 test images) one image is 0.28 points.

Last line: one JSON object (`iid_lossless_acc`, `default_noniid_acc` (the worse
partition), `default_noniid_gap_pts`, `best_noniid_acc`, `best_option`,
`fedavg_noniid_acc`, `stale_dropped_share`, `worst_site_acc` (the defaults' worst
site on any partition), `lm_bpb_gap`,
`audit_exact`, and per-run detail).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/noniid.py` from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.convergence import fedavg  # noqa: E402
from elasticfed.cloud import demo  # noqa: E402
from elasticfed.cloud.config import DemoConfig, GatewaySettings  # noqa: E402
from elasticfed.common.task import Task, load_task, shard  # noqa: E402


def defaults(
    spec: str, task: Task, args: argparse.Namespace, partition: str, loss: float, edges: int
) -> DemoConfig:
    """The demo harness carrying `cloud serve`'s and `elasticfed edge`'s defaults, not the demo's own."""
    g = GatewaySettings()
    return DemoConfig(
        edges=edges,
        rounds=1_000_000,
        time_limit_s=args.time_s if task.metric == "accuracy" else args.lm_time_s,
        loss=loss,
        burst=args.burst,
        timeout_ms=args.timeout_ms,
        edge_lr=task.lr,
        partition=partition,
        weighting=g.weighting,
        drain_s=args.drain_s,
        momentum=g.momentum,
        quorum=g.quorum,
        round_deadline_s=g.round_deadline_s,
        max_staleness=g.max_staleness,
        staleness_exponent=g.staleness_exponent,
        seed=args.seed,
        task=spec,
    )


def site_mixes(task: Task, partition: str, edges: int, seed: int) -> list[torch.Tensor]:
    """Each site's label shares in its training data (what its own held-out data looks like)."""
    data = task.train_set()
    mixes = []
    for i in range(edges):
        part = shard(data, i, edges, partition, seed=seed)
        labels = torch.tensor([int(data[j][1]) for j in part.indices])  # type: ignore[attr-defined]
        counts = torch.bincount(labels, minlength=10).double()
        mixes.append(counts / counts.sum())
    return mixes


def per_class_accuracy(task: Task, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = task.build_model()
    model.load_state_dict(state)
    model.eval()
    xs, ys = zip(*[task.test_set()[i] for i in range(len(task.test_set()))])  # type: ignore[arg-type]
    x, y = torch.stack(list(xs)), torch.tensor([int(v) for v in ys])
    with torch.no_grad():
        hit = (model(x).argmax(1) == y).double()
    return torch.stack(
        [hit[y == c].mean() if bool((y == c).any()) else hit.new_tensor(0.0) for c in range(10)]
    )


def site_accuracies(task: Task, state: dict[str, torch.Tensor], mixes: list[torch.Tensor]) -> list[float]:
    by_class = per_class_accuracy(task, state)
    return [round(float((mix * by_class).sum()), 4) for mix in mixes]


def run_ours(name: str, config: DemoConfig, gateway: dict[str, Any] | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    log = io.StringIO()
    started = time.monotonic()
    demo.run(None, config, out=log, result=figures, gateway_settings=gateway)
    if not figures.get("audit_ok"):
        print(f"noniid: {name}: the count audit failed:\n{log.getvalue()}", file=sys.stderr)
    if figures.get("diverged"):
        print(f"noniid: {name}: the gateway stopped: {figures['diverged']}", file=sys.stderr)
    produced = figures.get("produced_steps", 0)
    figures["stale_dropped_share"] = (
        round(figures.get("dropped_stale_steps", 0) / produced, 4) if produced else None
    )
    figures["wall_s"] = round(time.monotonic() - started, 1)
    metric = figures.get("metric", "accuracy")
    audit = "OK" if figures.get("audit_ok") else "FAILED"
    print(
        f"  {name}: {metric} {figures.get(metric)} (live model {figures.get('live', {}).get(metric)}) "
        f"after {figures.get('rounds')} rounds, "
        f"stale-dropped {figures['stale_dropped_share']}, audit {audit} "
        f"({figures['wall_s']} s)",
        flush=True,
    )
    return figures


def parse_best(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`momentum=0.9,prox_mu=0.1` -> (GatewaySettings overrides, DemoConfig overrides: the edges'),
    typed like the defaults."""
    g, d = GatewaySettings(), DemoConfig()
    gateway: dict[str, Any] = {}
    edges: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if hasattr(g, key):
            target, kind = gateway, type(getattr(g, key))
        elif key in ("prox_mu", "scaffold"):
            target, kind = edges, type(getattr(d, key))
        else:
            raise SystemExit(f"noniid: --best {item!r}: neither a gateway setting nor prox_mu")
        target[key] = kind(value) if kind is not bool else value.lower() in ("1", "true", "yes")
    return gateway, edges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--time-s", type=float, default=45.0, help="training budget of every digits run")
    parser.add_argument("--edges", type=int, default=8)
    parser.add_argument("--loss", type=float, default=0.3, help="message loss each way")
    parser.add_argument("--burst", type=float, default=3.0, help="mean loss burst, messages")
    parser.add_argument("--timeout-ms", type=int, default=100, help="the edges' per-layer deadline")
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--partitions", default="dirichlet:0.1,shards")
    parser.add_argument(
        "--best", default=BEST, help="the 'best option' contender: gateway settings and prox_mu, k=v,..."
    )
    parser.add_argument("--lm", action=argparse.BooleanOptionalAction, default=True, help="the text task too")
    parser.add_argument("--lm-task", default="stdlib-lm")
    parser.add_argument("--lm-edges", type=int, default=4)
    parser.add_argument("--lm-time-s", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="12 s runs, 4 edges, one partition, no text task"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.time_s, args.edges, args.partitions, args.lm = 12.0, 4, "dirichlet:0.1", False
    best_gateway, best_edges = parse_best(args.best)
    task = load_task("digits")
    partitions = [p for p in args.partitions.split(",") if p]
    t0 = time.monotonic()
    print(
        f"noniid: digits, {args.edges} edges, {args.time_s:.0f} s per run, {args.loss:.0%} message loss "
        f"(bursts of {args.burst:g}); partitions {', '.join(partitions)}; best = {args.best}",
        flush=True,
    )
    runs: dict[str, dict[str, Any]] = {}
    ref = run_ours(
        "reference (defaults, iid, lossless)", defaults("digits", task, args, "iid", 0.0, args.edges)
    )
    runs["reference"] = {"acc": ref["accuracy"], "audit_ok": ref["audit_ok"], "rounds": ref["rounds"]}
    for partition in partitions:
        mixes = site_mixes(task, partition, args.edges, args.seed)
        for label, gateway, edges in (("defaults", None, {}), ("best", best_gateway, best_edges)):
            config = replace(defaults("digits", task, args, partition, args.loss, args.edges), **edges)
            fig = run_ours(f"{label}, {partition}", config, gateway)
            runs[f"{label} {partition}"] = {
                "acc": fig["accuracy"],
                "live_acc": fig.get("live", {}).get("accuracy"),  # the model edges train from
                "sites": site_accuracies(task, fig["model_state"], mixes),
                "stale_dropped_share": fig["stale_dropped_share"],
                "rounds": fig["rounds"],
                "audit_ok": fig["audit_ok"],
            }
        state: dict[str, torch.Tensor] = {}
        trace = fedavg(
            task,
            args.edges,
            args.time_s,
            1_000_000,
            args.seed,
            message_loss=args.loss,
            timeout_s=args.timeout_ms / 1000,
            partition=partition,
            model_out=state,
        )
        runs[f"fedavg {partition}"] = {
            "acc": round(trace[-1][2], 4),
            "sites": site_accuracies(task, state, mixes),
            "rounds": trace[-1][1],
        }
        print(f"  fedavg, {partition}: accuracy {trace[-1][2]:.4f} after {trace[-1][1]} rounds", flush=True)
    lm: dict[str, Any] = {}
    if args.lm:
        lm_task = load_task(args.lm_task)
        for partition in ("iid", "package"):
            fig = run_ours(
                f"{args.lm_task} {partition} (defaults, lossless)",
                defaults(args.lm_task, lm_task, args, partition, 0.0, args.lm_edges),
            )
            lm[partition] = {"bpb": fig.get("bits_per_byte"), "audit_ok": fig["audit_ok"]}
    worst = min(partitions, key=lambda p: runs[f"defaults {p}"]["acc"])
    best_worst = min(partitions, key=lambda p: runs[f"best {p}"]["acc"])
    fedavg_worst = min(partitions, key=lambda p: runs[f"fedavg {p}"]["acc"])
    ours = [r for k, r in runs.items() if not k.startswith("fedavg")]
    result = {
        "task": "digits",
        "edges": args.edges,
        "loss": args.loss,
        "burst": args.burst,
        "time_s": args.time_s,
        "partitions": partitions,
        "iid_lossless_acc": runs["reference"]["acc"],
        "default_noniid_acc": runs[f"defaults {worst}"]["acc"],
        "default_noniid_partition": worst,
        "default_noniid_gap_pts": round(
            100 * (runs["reference"]["acc"] - runs[f"defaults {worst}"]["acc"]), 2
        ),
        "best_noniid_acc": runs[f"best {best_worst}"]["acc"],
        "best_option": args.best,
        "fedavg_noniid_acc": runs[f"fedavg {fedavg_worst}"]["acc"],
        "stale_dropped_share": max(runs[f"defaults {p}"]["stale_dropped_share"] or 0.0 for p in partitions),
        "worst_site_acc": min(min(runs[f"defaults {p}"]["sites"]) for p in partitions),  # any partition
        "lm_bpb_gap": (
            round((lm["package"]["bpb"] - lm["iid"]["bpb"]) / lm["iid"]["bpb"], 4)
            if lm.get("package", {}).get("bpb") and lm.get("iid", {}).get("bpb")
            else None
        ),
        "lm": lm or None,
        "audit_exact": all(r["audit_ok"] for r in ours) and all(v["audit_ok"] for v in lm.values()),
        "runs": runs,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


# FedAvgM (server momentum; Hsu et al. 2019 found it the remedy for label skew), the best mean of
# the options tried here (README, "Non-IID data"); `--best ''` runs the defaults twice.
BEST = "momentum=0.9"

if __name__ == "__main__":
    sys.exit(main())
