package provider

import (
	corev1 "k8s.io/api/core/v1"
)

// podRun is one pod's work on the node: it owns the pod's record (rec),
// made with it, and holds the node it runs on (node: what the node's pods
// share) and the node's pod map as a podSet. The node's pod map (VMs.pods)
// holds each pod's run. The steps and actions of the pod's worker are its
// methods, in the files of their jobs: the worker itself (run, worker.go),
// the requests it serves (request, power.go) and the delete request
// (requestDelete, lifecycle.go), the start (start.go), power off
// (power.go), the delete (delete.go, state.go), the exporter's side
// (exporter.go), the snapshot start and save (snapshots.go), the probes
// (probes.go), the feature hold (features.go), the boot's end
// (podtelemetry.go). The worker (worker.go) is the one goroutine that
// runs them, but for a rejected pod's delete, which has no worker
// (finishDelete). The exporter glue (podExporter) and the probes' sink
// (podProbeSink) hold the run. Its fields are set by VMs.newRun and never
// changed; the record says who writes each of its own (record.go).
type podRun struct {
	node *nodeWide
	pods podSet
	rec  *podVM
}

// podSet is what a pod's run needs of the node's pod map (VMs, vms.go).
type podSet interface {
	// admitting calls f with the pods admission counts (every active
	// pod's claim, the run's own included) under admission's lock: no pod
	// is admitted meanwhile. It returns f's error.
	admitting(f func(active []*corev1.Pod) error) error
	// forget removes the run from the map, if the map still holds it.
	forget(r *podRun)
}
