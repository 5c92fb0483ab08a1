// Package guest reaches into a running VM the way kubectl reaches into a
// container: the console log (logs), the serial console (attach), guest
// TCP ports (port-forward) and commands through the guest agent (exec),
// as functions over a VM. The probes and the Jumpstarter exporter's
// drivers use the same functions.
//
// guest knows package qemu's types and the kubelet API's stream types; it
// knows nothing of pods' records or workers (package provider finds the
// pod's VM and calls in).
package guest
