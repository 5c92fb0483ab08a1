package provider

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// Power and flash requests (requests.go): the pod's exporter (package
// exporter, the jumpstarter.Target of the VM, through podExporter) sends
// them to the pod's worker (run in worker.go), which alone stops, starts
// and re-images the VM; what each means in the worker's state is its
// machine's (next, podworker.go).

// Why a request was not served.
var (
	errPodDeleted  = errors.New("the pod is being deleted")
	errPodFinished = errors.New("the pod has finished (its restart policy does not run the VM again); recreate the pod")
	errWorkerGone  = errors.New("the node agent is shutting down")
)

// request sends a request to the pod's worker and waits for its answer
// (or ctx). The worker keeps serving a request the caller gave up on.
func (r *podRun) request(ctx context.Context, req vmRequest) error {
	rec := r.rec
	req.reply = make(chan error, 1)
	select {
	case rec.ctl <- req:
	case <-rec.done:
		req.release()
		return fmt.Errorf("%s: %w", req.op, errPodDeleted)
	case <-ctx.Done():
		req.release()
		return fmt.Errorf("%s: %w", req.op, ctx.Err())
	}
	select {
	case err := <-req.reply:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%s: still in progress on the node: %w", req.op, ctx.Err())
	}
}

// powerGrace is the grace period of a requested power off: the pod's
// terminationGracePeriodSeconds, as for a delete.
func (p *nodeWide) powerGrace(pod *corev1.Pod) time.Duration {
	if g := pod.Spec.TerminationGracePeriodSeconds; g != nil {
		return time.Duration(*g) * time.Second
	}
	return p.cfg.DefaultGrace
}

// powerOff stops the running VM as a delete does (ACPI power button within
// the pod's grace, then quit, then kill; now: quit at once, kill after
// powerOffNowQuit, as upstream's QEMU power off) but keeps the state dir
// and the pod: the container shows Waiting/PoweredOff with this run's end
// as its last state, and the restart policy does not apply. Worker only.
func (r *podRun) powerOff(ctx context.Context, why string, now bool) error {
	p, rec := r.node, r.rec
	vm := rec.vm.get()
	pod, st := rec.read()
	started := runStart(&st)
	log := klog.FromContext(ctx)
	opts := powerOffStop(p.powerGrace(pod), now || exporter.BootsEmptyDisk(st))
	p.event(pod, corev1.EventTypeNormal, "PoweringOff", powerOffMessage(why, opts))
	// Not bounded by ctx: a stop once begun finishes (the agent's shutdown
	// included), so the VM is never left half-stopped.
	ex, err := vm.Stop(context.WithoutCancel(ctx), opts)
	if _, exited := vm.Exit(); !exited {
		return fmt.Errorf("power off: %w", err)
	}
	if err != nil {
		log.Error(err, "Power off: clean state dir")
	}
	p.cfg.Telemetry.VMExited(rec.uid, ex)
	term := podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(rec.uid))
	log.Info("VM powered off on request", "why", why, "exitCode", ex.ExitCode, "reason", ex.Reason)
	rec.vm.set(nil)
	r.update(func(st *podstatus.VMState) {
		st.LastTerminated = &term
		st.SetWaiting(podstatus.ReasonPoweredOff, fmt.Sprintf("powered off %s (%s); power it on to boot again", why, ex.Reason))
		st.PoweredOff = true
	})
	p.event(pod, corev1.EventTypeNormal, podstatus.ReasonPoweredOff, fmt.Sprintf("VM powered off %s: %s", why, ex.Reason))
	return nil
}

// powerOffNowQuit is how long QEMU gets to quit in a power off at once
// before it is killed (upstream's QEMU driver: terminate, kill after 5 s).
const powerOffNowQuit = 5 * time.Second

// powerOffStop is how a power off stops the VM: through the ACPI power
// button within the pod's grace, or (now: asked so, or the VM boots its
// empty disk, where no guest answers the button) at once.
func powerOffStop(grace time.Duration, now bool) qemu.StopOptions {
	if now {
		return qemu.StopOptions{NoACPI: true, QuitGrace: powerOffNowQuit, Keep: []string{"*"}}
	}
	return qemu.StopOptions{Grace: podstatus.ACPIBudget(grace), QuitGrace: podstatus.QuitGrace, Keep: []string{"*"}}
}

// powerOffMessage is the PoweringOff event's message for a stop.
func powerOffMessage(why string, opts qemu.StopOptions) string {
	if opts.NoACPI {
		return fmt.Sprintf("Powering off the VM %s at once (quit, kill after %s)", why, opts.QuitGrace)
	}
	return fmt.Sprintf("Powering off the VM %s (ACPI power button, %s before quit)", why, opts.Grace.Round(time.Second))
}

// startError is why the last start failed (the terminated run it left).
func (r *podRun) startError() error {
	rec := r.rec
	if t := rec.stateCopy().Terminated; t != nil {
		return fmt.Errorf("start VM: %s: %s", t.Reason, t.Message)
	}
	return errors.New("start VM: failed")
}
