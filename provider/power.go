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

// Power and flash requests: the pod's exporter (package exporter, the
// jumpstarter.Target of the VM, through podExporter) sends them to the
// pod's worker (run in worker.go), which alone stops, starts and re-images
// the VM.

// vmOp is what a request asks of the worker.
type vmOp int

const (
	opPowerOn vmOp = iota + 1
	opPowerOff
	opFlash
)

func (o vmOp) String() string {
	switch o {
	case opPowerOn:
		return "power on"
	case opPowerOff:
		return "power off"
	case opFlash:
		return "flash"
	}
	return "unknown"
}

// vmRequest is one power or flash request. reply is buffered (1): the
// worker never blocks answering, even when the caller gave up.
type vmRequest struct {
	op vmOp
	// flash (opFlash) is what to install: a pulled and verified image or
	// partition, with its hold, released by whoever ends up not using it
	// (the worker once it took the request).
	flash *exporter.Flash
	reply chan error
}

// what names what a flash request installs.
func (r *vmRequest) what() string {
	if r.flash != nil {
		return r.flash.What()
	}
	return r.op.String()
}

// release gives up the request's hold (idempotent per request).
func (r *vmRequest) release() {
	if r.flash != nil {
		r.flash.Release()
	}
}

// refuse answers a request the worker cannot serve.
func (r *vmRequest) refuse(err error) {
	r.release()
	r.reply <- err
}

// reqAction is what the worker does with a request (decideRequest); the
// worker's transition (next, podworker.go) turns it into a state and
// actionKinds.
type reqAction int

const (
	// reqAnswer: nothing to do (already in the asked state): answer at once.
	reqAnswer reqAction = iota + 1
	// reqRefuse: the pod cannot run again: answer with errPodFinished.
	reqRefuse
	// reqPowerOff: stop the VM and stay off.
	reqPowerOff
	// reqStart: leave the powered-off state and start; answered by the start.
	reqStart
	// reqInstall: make the flashed image the one to boot; stay off.
	reqInstall
	// reqReimage: stop the VM, install the flashed image, start; answered by
	// the start.
	reqReimage
	// reqStayOff: no VM runs (back-off): do not restart it, stay off.
	reqStayOff
)

// decideRequest is what the worker does with op in its state s (only
// stateRunning, statePoweredOff and stateBackOff serve requests; every
// other state refuses). Pure.
func decideRequest(s podState, op vmOp) reqAction {
	switch s {
	case stateRunning:
		switch op {
		case opPowerOff:
			return reqPowerOff
		case opFlash:
			return reqReimage
		}
		return reqAnswer
	case statePoweredOff:
		switch op {
		case opPowerOn:
			return reqStart
		case opFlash:
			return reqInstall
		}
		return reqAnswer
	case stateBackOff:
		switch op {
		case opPowerOn:
			return reqStart
		case opPowerOff:
			return reqStayOff
		case opFlash:
			return reqInstall
		}
	}
	return reqRefuse
}

// Why a request was not served.
var (
	errPodDeleted  = errors.New("the pod is being deleted")
	errPodFinished = errors.New("the pod has finished (its restart policy does not run the VM again); recreate the pod")
	errWorkerGone  = errors.New("the node agent is shutting down")
)

// request sends a request to the pod's worker and waits for its answer
// (or ctx). The worker keeps serving a request the caller gave up on.
func (p *VMs) request(ctx context.Context, rec *podVM, req vmRequest) error {
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
func (p *VMs) powerGrace(pod *corev1.Pod) time.Duration {
	if g := pod.Spec.TerminationGracePeriodSeconds; g != nil {
		return time.Duration(*g) * time.Second
	}
	return p.cfg.DefaultGrace
}

// powerOff stops the running VM as a delete does (ACPI power button within
// the pod's grace, then quit, then kill) but keeps the state dir and the
// pod: the container shows Waiting/PoweredOff with this run's end as its
// last state, and the restart policy does not apply. Worker only.
func (p *VMs) powerOff(ctx context.Context, rec *podVM, vm VM, why string) error {
	rec.mu.Lock()
	pod := rec.pod.DeepCopy()
	started := time.Now()
	if rec.state.Running != nil {
		started = rec.state.Running.StartedAt.Time
	}
	rec.mu.Unlock()
	log := klog.FromContext(ctx)
	acpi := podstatus.ACPIBudget(p.powerGrace(pod))
	p.event(pod, corev1.EventTypeNormal, "PoweringOff", fmt.Sprintf("Powering off the VM %s (ACPI power button, %s before quit)", why, acpi.Round(time.Second)))
	// Not bounded by ctx: a stop once begun finishes (the agent's shutdown
	// included), so the VM is never left half-stopped.
	ex, err := vm.Stop(context.WithoutCancel(ctx), qemu.StopOptions{Grace: acpi, QuitGrace: podstatus.QuitGrace, Keep: []string{"*"}})
	if _, exited := vm.Exit(); !exited {
		return fmt.Errorf("power off: %w", err)
	}
	if err != nil {
		log.Error(err, "Power off: clean state dir")
	}
	p.cfg.Telemetry.VMExited(rec.uid, ex)
	term := podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(rec.uid))
	log.Info("VM powered off on request", "why", why, "exitCode", ex.ExitCode, "reason", ex.Reason)
	rec.mu.Lock()
	rec.vm = nil
	rec.mu.Unlock()
	p.update(rec, func(st *podstatus.VMState) {
		st.LastTerminated = &term
		st.SetWaiting(podstatus.ReasonPoweredOff, fmt.Sprintf("powered off %s (%s); power it on to boot again", why, ex.Reason))
		st.PoweredOff = true
	})
	p.event(pod, corev1.EventTypeNormal, podstatus.ReasonPoweredOff, fmt.Sprintf("VM powered off %s: %s", why, ex.Reason))
	return nil
}

// startError is why the last start failed (the terminated run it left).
func (p *VMs) startError(rec *podVM) error {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if t := rec.state.Terminated; t != nil {
		return fmt.Errorf("start VM: %s: %s", t.Reason, t.Message)
	}
	return errors.New("start VM: failed")
}
