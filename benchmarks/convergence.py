"""Convergence under loss: a task, 4 edges, the same budget for every link, against synchronous FedAvg.

Each run is `elasticfed demo` (the gateway in this process, 4 edge processes,
IID shards) with a fixed budget of wall time and rounds, recording the task's
test figure for the gateway's model against time (`--task digits`, the
default: accuracy, higher is better; `--task stdlib-lm-base`: bits per byte,
lower is better):

- message loss 0/30/60/95% (each direction, independent per message unless
  `--burst`), injected in process by the edges' fault channel: fast, exact;
- packet loss 0/10/30% in the kernel: each edge in its own network namespace,
  nftables dropping that share of its packets both ways (tests/netns.py), TCP
  doing what TCP does.  Needs root, `ip`, `nft` and `tc`; otherwise skipped and
  the JSON says why.

The reference, in the same run: synchronous FedAvg on the same model, data and
shards: every round all 4 clients train one local epoch from the global model
and the server averages the models, waiting for all.  Its clock counts the
slowest client of each round (clients in parallel, communication free): a
lower bound on its time on any real link, where every lost message would stall
the whole round.

Writes `convergence.csv` (one row per evaluation: run, seconds, rounds, and
the figure under its metric's name) and `convergence.png` (the figure against
time, one line per run) to `--out-dir`.  Last line: one JSON object, its keys
named after the metric's short label (`final_acc`, `final_bpb`, ...), and
`time_to_<target>_s` for each of `--targets` (digits: 90% and 95%).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/convergence.py` from a checkout
    sys.path.insert(0, str(REPO))

from elasticfed.cloud import demo  # noqa: E402
from elasticfed.cloud.config import DemoConfig  # noqa: E402
from elasticfed.common.task import Task, load_task, shard  # noqa: E402

TASK = "digits"
LOOPBACK_RTT_S = 0.001  # what a successful exchange costs FedAvg on the simulated lossy link
TracePoint = tuple[float, int, float]


def run_fleet(
    name: str, config: DemoConfig, lab: Any = None, packet_loss: int = 0
) -> tuple[list[TracePoint], dict[str, Any]]:
    """One demo run; with `lab`, every edge in its own namespace losing `packet_loss`% of packets."""
    trace: list[TracePoint] = []
    figures: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    nets = []
    if lab is not None:
        nets = [lab.add_edge() for _ in range(config.edges)]
        for net in nets:
            net.set_loss(packet_loss, packet_loss)

        def edge_command(i: int, argv: list[str], endpoint: str) -> list[str]:
            port = endpoint.rsplit(":", 1)[1]
            argv = [a if a != endpoint else f"tcp://{lab.gateway_address}:{port}" for a in argv]
            return nets[i].argv(argv)

        kwargs = {"bind": "tcp://0.0.0.0:0", "edge_command": edge_command}
    log = io.StringIO()
    started = time.monotonic()
    try:
        demo.run(None, config, out=log, trace=trace, result=figures, **kwargs)
    finally:
        for net in nets:
            net.close()
    figures["wall_s"] = round(time.monotonic() - started, 1)
    if not figures.get("audit_ok"):  # the whole report (per-edge table, exit codes) says why
        print(f"convergence: {name}: the count audit failed:\n{log.getvalue()}", file=sys.stderr)
    syncs = [line.strip() for line in log.getvalue().splitlines() if line.strip().startswith("weak syncs")]
    metric = figures.get("metric", "accuracy")
    print(
        f"  {name}: {metric} {figures.get(metric)} after {figures.get('rounds')} rounds; "
        + (syncs[-1] if syncs else "")
    )
    return trace, figures


def transfer_s(rng: random.Random, loss: float, timeout_s: float) -> float:
    """One request/response over a link losing `loss` of messages each way, retried on timeout."""
    spent = 0.0
    while rng.random() < loss or rng.random() < loss:  # the request or its answer was lost
        spent += timeout_s
    return spent + LOOPBACK_RTT_S


def fedavg(
    task: Task,
    clients: int,
    time_s: float,
    rounds: int,
    seed: int,
    message_loss: float = 0.0,
    timeout_s: float = 0.1,
    local_steps: int = 50,
    partition: str = "iid",
    model_out: dict[str, torch.Tensor] | None = None,
) -> list[TracePoint]:
    """Synchronous FedAvg: all clients, one local epoch each, wait for all, average the models.

    `partition` splits the clients' data as the edges' (common.task.shard); `model_out`
    receives the final global model's state.  An epoch longer than `local_steps` is cut
    there (digits' is 11 steps; stdlib-lm's thousands, which would make one round outlast
    any budget).

    Compute is measured; with `message_loss`, each client's model download and upload is a
    request/response retried every `timeout_s` (the edges' deadline), its time drawn
    from the same per-message loss (independent, each way) as the edges' links.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    global_model = task.build_model()
    data = task.train_set()
    test = task.test_set()
    loaders = [
        DataLoader(
            shard(data, i, clients, partition, seed=seed),
            batch_size=task.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed + 17 + i),
        )
        for i in range(clients)
    ]
    local = task.build_model()
    # Warm up: first calls (the optimizer's first step imports half of torch) are not FedAvg's
    # cost, and the edges have paid theirs before the clock starts.
    x, y = next(iter(loaders[0]))
    warm = torch.optim.SGD(local.parameters(), lr=0.0)
    task.loss(local(x), y).backward()
    warm.step()
    clock = 0.0
    trace: list[TracePoint] = [(0.0, 0, task.evaluate(global_model, test))]
    for r in range(1, rounds + 1):
        states = []
        slowest = 0.0
        for loader in loaders:
            t0 = time.perf_counter()
            local.load_state_dict(global_model.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=task.lr, momentum=task.momentum)
            for step, (x, y) in enumerate(loader):
                if step >= local_steps:
                    break
                loss = task.loss(local(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in local.state_dict().items()})
            link = 0.0
            if message_loss:  # the model down, the update up
                link = transfer_s(rng, message_loss, timeout_s) + transfer_s(rng, message_loss, timeout_s)
            slowest = max(slowest, time.perf_counter() - t0 + link)
        t0 = time.perf_counter()
        averaged = {
            k: torch.stack([s[k].float() for s in states]).mean(0).to(states[0][k].dtype) for k in states[0]
        }
        global_model.load_state_dict(averaged)
        clock += slowest + time.perf_counter() - t0
        trace.append((clock, r, task.evaluate(global_model, test)))
        if clock >= time_s:
            break
    if model_out is not None:
        model_out.update({k: v.detach().clone() for k, v in global_model.state_dict().items()})
    return trace


def time_to(trace: list[TracePoint], target: float, higher_is_better: bool = True) -> float | None:
    """Seconds until the figure first reached `target`, in the metric's own direction; None: never."""
    return next(
        (round(t, 1) for t, _, v in trace if (v >= target if higher_is_better else v <= target)), None
    )


def plot(
    traces: dict[str, list[TracePoint]], path: Path, title: str, task: Task, targets: list[float]
) -> str | None:
    """The figure against time: message loss and packet loss side by side, FedAvg on both."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("convergence: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    panels = [("message loss (in process)", "message"), ("packet loss (kernel, TCP)", "packet")]
    percent = task.metric == "accuracy"
    scale = 100.0 if percent else 1.0
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), dpi=110, sharey=True)
    runs = [name for name in traces if not name.startswith("fedavg")]
    colours = {name: f"C{i}" for i, name in enumerate(runs)}
    for ax, (label, kind) in zip(axes, panels):
        for name, trace in traces.items():
            lossy_fedavg = name.startswith("fedavg, ")
            if name != "fedavg" and not name.startswith(kind) and not (lossy_fedavg and kind == "message"):
                continue
            if name == "fedavg":
                style = {"color": "black", "ls": "--"}
            elif lossy_fedavg:  # same colour as our run at that loss, dotted
                style = {"color": colours.get(name.split(", ", 1)[1], "grey"), "ls": ":"}
            else:
                style = {"color": colours[name], "ls": "-"}
            ax.plot([t for t, _, _ in trace], [v * scale for _, _, v in trace], label=name, lw=1.5, **style)
        for level in targets:
            ax.axhline(level * scale, color="grey", lw=0.6, ls=":")
        ax.set_xscale("symlog", linthresh=1.0)  # the first seconds matter most
        ax.set_xlim(left=0)
        ax.set_xlabel("seconds since the first edge started training")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right" if task.higher_is_better else "upper right", fontsize=8)
    metric = task.metric.replace("_", " ")
    axes[0].set_ylabel(f"test {metric} of the gateway's model{' (%)' if percent else ''}, {task.direction}")
    if percent:
        axes[0].set_ylim(0, 100)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--time-s", type=float, default=12.0, help="training budget of every run (the README's figures: 60)"
    )
    parser.add_argument("--rounds", type=int, default=500, help="round budget of every run")
    parser.add_argument("--losses", default="0,30,60,95", help="message loss rates, percent")
    parser.add_argument(
        "--packet-losses", default="0,10,30", help="kernel packet loss rates, percent ('': none)"
    )
    parser.add_argument(
        "--burst", type=float, default=1.0, help="mean loss burst in messages (1: independent)"
    )
    parser.add_argument("--weighting", default="buffered", choices=("buffered", "mean-step"))
    parser.add_argument("--timeout-ms", type=int, default=100)
    parser.add_argument("--drain-s", type=float, default=3.0, help="time edges get to deliver at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--task", default=TASK, help="built-in short name or module:function (e.g. stdlib-lm-base)"
    )
    parser.add_argument("--local-steps", type=int, default=50, help="FedAvg's local steps per round, at most")
    parser.add_argument(
        "--targets",
        default="",
        help="figures to time, comma-separated (default: 0.9,0.95 for accuracy, none otherwise)",
    )
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = load_task(args.task)
    if args.targets:
        targets = [float(v) for v in args.targets.split(",") if v.strip()]
    else:
        targets = [0.90, 0.95] if task.metric == "accuracy" else []
    base = DemoConfig(
        edges=4,
        rounds=args.rounds,
        time_limit_s=args.time_s,
        burst=args.burst,
        delay_ms=0.0,
        jitter_ms=0.0,
        timeout_ms=args.timeout_ms,
        weighting=args.weighting,
        drain_s=args.drain_s,
        seed=args.seed,
        task=args.task,
    )
    traces: dict[str, list[TracePoint]] = {}
    runs: dict[str, dict[str, Any]] = {}
    print(
        f"convergence: {task.name}, {args.time_s:.0f} s / {args.rounds} rounds per run, weighting "
        f"{args.weighting}; figure: {task.metric.replace('_', ' ')} ({task.direction})"
    )

    t0 = time.monotonic()
    message_losses = [int(v) for v in args.losses.split(",") if v.strip()]
    traces["fedavg"] = fedavg(
        task, base.edges, args.time_s, args.rounds, args.seed, local_steps=args.local_steps
    )
    print(f"  fedavg: {task.metric} {traces['fedavg'][-1][2]:.4f} after {traces['fedavg'][-1][1]} rounds")
    for pct in (p for p in message_losses if p):
        name = f"fedavg, message loss {pct}%"
        traces[name] = fedavg(
            task,
            base.edges,
            args.time_s,
            args.rounds,
            args.seed,
            pct / 100,
            base.timeout_ms / 1000,
            local_steps=args.local_steps,
        )
        print(f"  {name}: {task.metric} {traces[name][-1][2]:.4f} after {traces[name][-1][1]} rounds")

    for pct in message_losses:
        name = f"message loss {pct}%"
        traces[name], runs[name] = run_fleet(name, _with_loss(base, pct / 100))

    packet = {int(v) for v in args.packet_losses.split(",") if v.strip()}
    packet_skipped = None
    if packet:
        try:
            sys.path.insert(0, str(REPO / "tests"))
            from netns import Lab, Unavailable  # tests/netns.py: the real-loss harness
        except ImportError as exc:
            packet_skipped = f"tests/netns.py cannot be imported: {exc}"
        else:
            try:
                lab = Lab.create()
            except Unavailable as exc:
                packet_skipped = str(exc)
            else:
                try:
                    for pct in sorted(packet):
                        name = f"packet loss {pct}%"
                        traces[name], runs[name] = run_fleet(name, _with_loss(base, 0.0), lab, pct)
                finally:
                    lab.close()
        if packet_skipped:
            print(f"  packet loss runs skipped: {packet_skipped}")

    csv_path = out_dir / "convergence.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "seconds", "rounds", task.metric])
        for name, trace in traces.items():
            for t, r, value in trace:
                writer.writerow([name, f"{t:.2f}", r, f"{value:.4f}"])
    title = (
        f"{task.name}, 4 edges, {args.weighting} weighting, {args.time_s:.0f} s budget.  Synchronous FedAvg: "
        "dashed on a perfect link, dotted over the same message loss (link time simulated)"
    )
    png = plot(traces, out_dir / "convergence.png", title, task, targets)

    def final(name: str) -> float:
        return round(traces[name][-1][2], 4)

    def ratio(ours: float | None, reference: float | None) -> float | None:
        return round(ours / reference, 2) if ours is not None and reference else None

    label = task.metric_label  # final_acc, final_bpb, ...
    up = task.higher_is_better

    def tag(target: float) -> str:  # time_to_90_s for accuracy 0.90, time_to_2.5_s for 2.5 bpb
        return f"{target * 100:g}" if task.metric == "accuracy" else f"{target:g}"

    def timed(prefix: str, names: dict[str, str]) -> dict[str, Any]:
        return {
            f"{prefix}time_to_{tag(t)}_s": {key: time_to(traces[run], t, up) for key, run in names.items()}
            for t in targets
        }

    ours = {str(p): f"message loss {p}%" for p in message_losses}
    kernel = {str(p): f"packet loss {p}%" for p in sorted(packet) if f"packet loss {p}%" in traces}
    lossy_fedavg = {str(p): f"fedavg, message loss {p}%" for p in message_losses if p}
    result = {
        "task": task.name,
        "metric": task.metric,
        "metric_higher_is_better": up,
        "targets": targets,
        f"final_{label}": {key: final(run) for key, run in ours.items()},
        **timed("", ours),
        "rounds": {key: runs[run].get("rounds") for key, run in ours.items()},
        "audit_ok": {key: runs[run].get("audit_ok") for key, run in ours.items()},
        f"packet_final_{label}": {key: final(run) for key, run in kernel.items()},
        **timed("packet_", kernel),
        "packet_audit_ok": {key: runs[run].get("audit_ok") for key, run in kernel.items() if run in runs},
        "packet_skipped": packet_skipped,
        f"fedavg_final_{label}": final("fedavg"),
        **{f"fedavg_time_to_{tag(t)}_s": time_to(traces["fedavg"], t, up) for t in targets},
        f"fedavg_lossy_final_{label}": {key: final(run) for key, run in lossy_fedavg.items()},
    }
    if targets:
        # Our time to the first target over synchronous FedAvg's on the same link (None: never got there).
        first = targets[0]
        fedavg_first = {
            p: time_to(traces["fedavg" if not p else f"fedavg, message loss {p}%"], first, up)
            for p in message_losses
        }
        result[f"time_to_{tag(first)}_ratio_vs_fedavg"] = {
            str(p): ratio(time_to(traces[f"message loss {p}%"], first, up), fedavg_first[p])
            for p in message_losses
        }
        result[f"fedavg_lossy_time_to_{tag(first)}_s"] = {
            key: time_to(traces[run], first, up) for key, run in lossy_fedavg.items()
        }
    result |= {
        "budget_s": args.time_s,
        "weighting": args.weighting,
        "burst": args.burst,
        "csv": str(csv_path),
        "plot": png,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))


def _with_loss(config: DemoConfig, loss: float) -> DemoConfig:
    from dataclasses import replace

    return replace(config, loss=loss)


if __name__ == "__main__":
    main()
