// Package telemetry is what the node tells of its pods' starts and VMs:
// the Prometheus metrics (Metrics, StateCollector), the OpenTelemetry
// spans of a pod's start (pull, overlay, QEMU start, boot) and the
// per-pod start timeline of the burst benchmarks. Telemetry is optional:
// a nil *Telemetry records nothing.
//
// telemetry reads the pods through small interfaces (Pods, StartedVM); it
// knows nothing of the pod worker (package provider calls in).
package telemetry
