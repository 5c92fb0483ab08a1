package provider

// podRun is one pod's work on the node: its record (rec) and the node it
// runs on (p: the pod map and what is node-wide). The steps and actions of
// the pod's worker are its methods, in the files of their jobs: the start
// (start.go), power off (power.go), the delete (delete.go, state.go), the
// exporter's side (exporter.go), the snapshot start and save
// (snapshots.go), the probes (probes.go), the feature hold (features.go),
// the boot's end (podtelemetry.go). The worker (worker.go) is the one
// goroutine that runs them, but for a rejected pod's delete, which has no
// worker (finishDelete).
type podRun struct {
	p   *VMs
	rec *podVM
}

// runOf is the work of the pod whose record is rec.
func (p *VMs) runOf(rec *podVM) *podRun { return &podRun{p: p, rec: rec} }
