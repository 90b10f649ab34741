#!/usr/bin/env bash
# Copy a gateway key folder (made with `elasticfed keys init`, devices added with `keys enrol`,
# removed with `keys revoke`) into the cluster:
#   Secret    elasticfed-gateway-key  gateway.key, gateway.key_secret
#   ConfigMap elasticfed-enrolled     one NAME.key per enrolled device (public keys only)
# The running gateway sees a changed ConfigMap within about a minute (the kubelet's sync
# period) without a restart; a changed gateway key pair needs a restart (and every device
# needs the new gateway.key).
#
#   deploy/cloud/sync-keys.sh ./gateway-keys            # both
#   deploy/cloud/sync-keys.sh ./gateway-keys enrolled   # only the device list (after enrol/revoke)
#
# NAMESPACE=elasticfed, KUBECTL=kubectl. Server-side apply (kubectl >= 1.22): a client-side
# apply keeps a copy of the whole ConfigMap in an annotation, which is capped at 256 KiB
# (about 1,300 devices); a ConfigMap itself holds up to 1 MiB (about 5,000 device keys).
set -euo pipefail

usage() {
    echo "usage: $0 KEYS_DIR [all|enrolled]" >&2
    exit 2
}
if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
keys="$1"
what="${2:-all}"
NAMESPACE="${NAMESPACE:-elasticfed}"
KUBECTL="${KUBECTL:-kubectl}"

# Keys this script no longer sends (a revoked device) are removed: it owns the fields it applied.
apply() {
    "$KUBECTL" apply --server-side --field-manager=elasticfed-sync-keys --force-conflicts -f -
}

[ -d "$keys/enrolled" ] || {
    echo "$0: $keys is not a gateway key folder (no enrolled/); make one with: elasticfed keys init --keys-dir $keys" >&2
    exit 2
}

case "$what" in
all)
    for f in gateway.key gateway.key_secret; do
        [ -r "$keys/$f" ] || {
            echo "$0: cannot read $keys/$f" >&2
            exit 2
        }
    done
    "$KUBECTL" -n "$NAMESPACE" create secret generic elasticfed-gateway-key \
        --from-file=gateway.key="$keys/gateway.key" \
        --from-file=gateway.key_secret="$keys/gateway.key_secret" \
        --dry-run=client -o yaml | apply
    ;;
enrolled) ;;
*) usage ;;
esac

# Only *.key files: kubectl --from-file=DIR would also take anything else lying there.
args=()
count=0
for f in "$keys"/enrolled/*.key; do
    [ -e "$f" ] || continue
    args+=("--from-file=$(basename "$f")=$f")
    count=$((count + 1))
done
"$KUBECTL" -n "$NAMESPACE" create configmap elasticfed-enrolled ${args[@]+"${args[@]}"} \
    --dry-run=client -o yaml | apply
echo "$0: $count enrolled device key(s) in configmap/elasticfed-enrolled (namespace $NAMESPACE)"
