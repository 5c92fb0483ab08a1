#!/usr/bin/env bash
# unit-shim.sh CMD...: runs CMD (make unit's go test -short) with the tools
# that only the long tests may start (QEMU, qemu-img, the registry tools,
# the control plane) shadowed on PATH by a shim that records its call and
# fails, and with the control-plane location unset. Fails if the command
# fails or if any shimmed tool was called: -short must skip every test that
# needs one (internal/testutil.SkipIfShort).
set -uo pipefail
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
for tool in qemu-system-x86_64 qemu-system-aarch64 qemu-img oras skopeo etcd kube-apiserver kube-controller-manager kube-scheduler; do
	cat > "$shim/$tool" <<SH
#!/bin/sh
echo "$tool \$*" >> "$shim/called"
echo "$tool: started under make unit (-short): the test must skip (testutil.SkipIfShort)" >&2
exit 127
SH
	chmod +x "$shim/$tool"
done
start=$(date +%s)
PATH="$shim:$PATH" QK_CONTROL_PLANE_BIN= KUBEBUILDER_ASSETS= "$@"
rc=$?
echo "unit: $(( $(date +%s) - start ))s wall"
if [ -s "$shim/called" ]; then
	echo "unit: -short tests started tools they must not:" >&2
	sort "$shim/called" | uniq -c >&2
	exit 1
fi
exit $rc
