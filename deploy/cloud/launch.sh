#!/usr/bin/env bash
# Start this node's share of the hybrid job: torchrun with c10d rendezvous runs NPROC_PER_NODE
# workers of `python -m elasticfed.cloud serve --mode hybrid`. Every rank trains on cloud data with
# layer-wise sync (NCCL on GPUs); global rank 0 also hosts the edge gateway (GATEWAY_BIND) and
# the Prometheus endpoint (METRICS_BIND). Run the same command on every node.
#
# Settings (environment variables):
#   NNODES=1                 nodes in the job: N, or MIN:MAX for an elastic range (then rank 0,
#                            and with it the gateway, can move to another node; see deploy/README.md)
#   NPROC_PER_NODE=gpu       workers on this node: a number, or gpu (one per visible GPU), cpu, auto
#   RDZV_ENDPOINT=127.0.0.1:29400  HOST:PORT of the rendezvous store, the same on every node
#   JOB_ID=elasticfed        rendezvous id: the same on every node, new for an unrelated job
#   MAX_RESTARTS=3           torchrun restarts the workers of every node this often after a failure;
#                            they resume from the newest checkpoint in [train] checkpoint_dir
#   LOCAL_ADDR=              this node's address for the rendezvous (default: its FQDN)
#   CONFIG=                  TOML file for `cloud serve` (elasticfed cloud serve --help)
#   GATEWAY_BIND=tcp://*:7878  METRICS_BIND=0.0.0.0:9400
#   TORCHRUN=torchrun        DRY_RUN=1: print the command instead of running it
# Arguments are passed on to `cloud serve` after the settings above, so they win.
set -euo pipefail

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:29400}"
JOB_ID="${JOB_ID:-elasticfed}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
LOCAL_ADDR="${LOCAL_ADDR:-}"
CONFIG="${CONFIG:-}"
GATEWAY_BIND="${GATEWAY_BIND:-tcp://*:7878}"
METRICS_BIND="${METRICS_BIND:-0.0.0.0:9400}"
TORCHRUN="${TORCHRUN:-torchrun}"
DRY_RUN="${DRY_RUN:-0}"

if [ -n "$CONFIG" ] && [ ! -r "$CONFIG" ]; then
    echo "launch.sh: error: CONFIG=$CONFIG is not a readable file" >&2
    exit 2
fi

cmd=(
    "$TORCHRUN"
    --nnodes="$NNODES"
    --nproc-per-node="$NPROC_PER_NODE"
    --rdzv-backend=c10d
    --rdzv-endpoint="$RDZV_ENDPOINT"
    --rdzv-id="$JOB_ID"
    --max-restarts="$MAX_RESTARTS"
)
if [ -n "$LOCAL_ADDR" ]; then
    cmd+=(--local-addr="$LOCAL_ADDR")
fi
cmd+=(-m elasticfed.cloud serve --mode hybrid)
if [ -n "$CONFIG" ]; then
    cmd+=(--config "$CONFIG")
fi
cmd+=(--gateway-bind "$GATEWAY_BIND" --metrics-bind "$METRICS_BIND" "$@")

if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi
echo "launch.sh: node $(hostname) joining job $JOB_ID at $RDZV_ENDPOINT (nodes $NNODES, workers $NPROC_PER_NODE)" >&2
exec "${cmd[@]}"
