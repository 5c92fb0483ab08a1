package provider

import (
	"context"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/probe"
)

// startProbes starts the probes of the pod's container for this run of
// vm (probe.Start); rec.probes carries their results for the pod status
// (probe.Apply). They report through the pod's probe.Sink (podProbeSink),
// which wakes the worker on probed when their results change.
func (r *podRun) startProbes(ctx context.Context, vm VM, probed chan<- struct{}, failed chan<- probeFailure) {
	rec := r.rec
	pod, st := rec.read()
	if len(pod.Spec.Containers) == 0 {
		return
	}
	c := &pod.Spec.Containers[0]
	var run time.Time
	if st.Running != nil {
		run = st.Running.StartedAt.Time
	}
	state := probe.NewState(run)
	rec.probes.Store(state)
	probe.Start(ctx, vm, c, state, rec.deleteReq, podProbeSink{run: r, ctx: ctx, vm: vm, probed: probed, failed: failed})
}

// podProbeSink reports a run's probes to its pod: events, status pushes,
// a wake-up of the pod's worker (which turns a first Ready into its
// evReady: the boot's end, the memory snapshot a creator saves, the
// exporter), and a failed liveness or startup probe to the worker (its
// evProbeFailed: the worker alone kills the VM).
type podProbeSink struct {
	run *podRun
	ctx context.Context
	vm  VM
	// probed is the worker's (worker.probed): one pending wake-up is enough.
	probed chan<- struct{}
	// failed is the worker's (worker.probeFailed).
	failed chan<- probeFailure
}

// probeFailure is a failed liveness or startup probe of the run of vm,
// sent to the pod's worker.
type probeFailure struct {
	vm        VM
	kind, msg string
}

func (s podProbeSink) Event(typ, reason, msg string) {
	s.run.node.event(s.run.rec.podCopy(), typ, reason, msg)
}

func (s podProbeSink) Changed() {
	s.run.node.push(s.run.rec)
	select {
	case s.probed <- struct{}{}:
	default:
	}
}

// Failed hands the failure to the worker, waiting until it takes it or
// the run is over (the VM ended, the pod is deleted, the agent stops).
func (s podProbeSink) Failed(kind, msg string) {
	select {
	case s.failed <- probeFailure{vm: s.vm, kind: kind, msg: msg}:
	case <-s.vm.Done():
	case <-s.run.rec.deleteReq:
	case <-s.ctx.Done():
	}
}
