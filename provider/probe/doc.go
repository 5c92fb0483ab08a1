// Package probe runs a VM pod's startup, readiness and liveness probes the
// way the kubelet's prober does (tcpSocket and httpGet through a forward of
// the guest port, exec through the guest agent; the kubelet's timing and
// thresholds) and folds their results into the pod's status (Apply). A
// run's probes report to a Sink: events, a changed status, readiness.
//
// probe knows package guest and qemu's types; it knows nothing of the
// pod's record or worker (package provider starts the probes of each run).
package probe
