package jumpstarter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Lease hooks, as upstream Jumpstarter's exporter config defines them
// (hooks.beforeLease, hooks.afterLease: timeout, onFailure warn, endLease
// or exit; the exporter statuses BEFORE_LEASE_HOOK, AFTER_LEASE_HOOK and
// their *_FAILED), with VM actions for scripts, and the lease state
// policy's reset at every lease's end. What to run and what its outcome
// means are pure (afterLeaseHook, decideHook); runHook only does the
// actions. The Run goroutine runs the hooks (exporter.go's session).

// HookAction is one thing a hook does to the target.
type HookAction string

const (
	HookPowerOn    HookAction = "powerOn"
	HookPowerOff   HookAction = "powerOff"
	HookPowerCycle HookAction = "powerCycle"
	// HookReset returns the target to what its owner defines (Resetter).
	HookReset HookAction = "reset"
	// HookExec runs the step's Command in the guest (GuestExecer).
	HookExec HookAction = "exec"
	// HookFlash flashes the step's Image onto its Partition as flash_oci
	// does, with no credentials (what the node may pull for anyone).
	HookFlash HookAction = "flash"
)

// HookStep is one action of a hook, with what the action needs.
type HookStep struct {
	Action HookAction
	// Command is HookExec's argv (program and arguments, no shell).
	Command []string
	// Image and Partition are HookFlash's OCI reference and partition
	// ("": PartitionRoot).
	Image, Partition string
	// policyReset: the reset of the lease state policy (afterLeaseHook),
	// whose failure takes the exporter offline whatever the hook's
	// onFailure.
	policyReset bool
}

// String is the step for logs: the action, and for exec its program.
func (s HookStep) String() string {
	if s.Action == HookExec && len(s.Command) > 0 {
		return fmt.Sprintf("%s %s (%d args)", s.Action, s.Command[0], len(s.Command)-1)
	}
	if s.Action == HookFlash {
		return fmt.Sprintf("%s %s onto %s", s.Action, s.Image, cmp.Or(s.Partition, PartitionRoot))
	}
	return string(s.Action)
}

// GuestExecer is a Target that can run a command in its guest (exec hook
// steps), through an agent in the guest.
type GuestExecer interface {
	// GuestExec runs argv in the guest (no shell) and returns once it
	// exited. An error wrapping ErrGuestAgentNotReady means no agent
	// answered (a guest still booting): trying again may succeed.
	GuestExec(ctx context.Context, argv []string) (GuestExecResult, error)
}

// GuestExecResult is how a command run in the guest ended.
type GuestExecResult struct {
	ExitCode int
	Stderr   []byte
}

// ErrGuestAgentNotReady: the guest's agent did not answer (yet).
var ErrGuestAgentNotReady = errors.New("the guest agent does not answer (yet)")

// GuestExecRetry is the pause between two tries of an exec step whose
// guest agent did not answer; the hook's timeout bounds the tries.
const GuestExecRetry = time.Second

// maxStderrTail bounds the end of stderr a failed exec step quotes.
const maxStderrTail = 512

// OnFailure is what a failed or timed-out hook does.
type OnFailure string

const (
	// OnFailureWarn logs the failure and goes on as if the hook succeeded.
	OnFailureWarn OnFailure = "warn"
	// OnFailureEndLease reports the *_FAILED status; a beforeLease failure
	// also asks the controller to release the lease and serves no driver.
	OnFailureEndLease OnFailure = "endLease"
	// OnFailureExit reports the *_FAILED status and ends the exporter
	// (Run returns an error wrapping ErrHookExit).
	OnFailureExit OnFailure = "exit"
)

// DefaultHookTimeout bounds a hook that names no timeout (upstream's).
const DefaultHookTimeout = 120 * time.Second

// AfterLeaseFailedHold is how long an afterLease hook that failed with
// onFailure endLease is reported (AFTER_LEASE_HOOK_FAILED) before the
// exporter reports AVAILABLE again, its message keeping the failure, as
// upstream's exporter does: controllers assign leases only to AVAILABLE
// exporters, so the failed status alone would keep the target from every
// later lease.
const AfterLeaseFailedHold = time.Second

// Hook is one lease hook.
type Hook struct {
	Actions   []HookStep
	Timeout   time.Duration // <= 0: DefaultHookTimeout
	OnFailure OnFailure     // "": warn
}

// LeaseHooks are what the exporter does around each lease.
type LeaseHooks struct {
	// ResetAfterLease resets the target when a lease ends (the lease state
	// policy Reset), before AfterLease's actions.
	ResetAfterLease bool
	// BeforeLease and AfterLease are the hooks (nil: none).
	BeforeLease, AfterLease *Hook
}

// Resetter is a Target that can return to what its owner defines: the
// image, firmware, sizes and login it was created with, powered on.
type Resetter interface {
	ResetTarget(ctx context.Context) error
}

// errPolicyReset wraps the failure of the lease state policy's reset.
var errPolicyReset = errors.New("the lease state policy's reset failed")

// ErrHookExit: a hook with onFailure exit failed; the exporter went
// offline.
var ErrHookExit = errors.New("a lease hook with onFailure exit failed: the exporter went offline")

// ErrExitOnLeaseEnd: the lease ended and Config.ExitOnLeaseEnd is set;
// the exporter went offline for good.
var ErrExitOnLeaseEnd = errors.New("the lease ended and the exporter exits on lease end (exitOnLeaseEnd): the exporter went offline")

// afterLeaseHook is what runs when a lease ends: the reset of the lease
// state policy first (the set's definition), then the afterLease hook's
// actions (which may power it off for the next beforeLease to power on),
// under the hook's timeout and onFailure. The policy's reset that fails
// always fails with exit (decideHook): a target that could not be reset
// must not serve the next lease. nil: nothing runs. Pure.
func afterLeaseHook(h LeaseHooks) *Hook {
	if !h.ResetAfterLease {
		return h.AfterLease
	}
	out := &Hook{Actions: []HookStep{{Action: HookReset, policyReset: true}}, OnFailure: OnFailureExit}
	if a := h.AfterLease; a != nil {
		out.Actions = append(out.Actions, a.Actions...)
		out.Timeout, out.OnFailure = a.Timeout, a.OnFailure
	}
	return out
}

// hookPhase is when a hook runs.
type hookPhase int

const (
	beforeLease hookPhase = iota + 1
	afterLease
)

func (p hookPhase) String() string {
	if p == beforeLease {
		return "beforeLease"
	}
	return "afterLease"
}

// hookVerdict is what the exporter does once a phase is over.
type hookVerdict struct {
	status pb.ExporterStatus // reported to the controller, answered by GetStatus
	msg    string
	// release asks the controller to release the lease (a beforeLease
	// hook failed with endLease or exit): the client is never served.
	release bool
	// exit: the exporter goes offline (Run ends with ErrHookExit).
	exit bool
	// warn: the failure is only logged (onFailure warn).
	warn bool
	// thenAvailable: once the failed status was reported for
	// AfterLeaseFailedHold, AVAILABLE is reported with this message (an
	// afterLease hook failed with endLease). "": the status stays.
	thenAvailable string
}

// decideHook is the outcome of phase's hook h (nil: none ran) that
// ended with err (nil: done). Pure.
func decideHook(phase hookPhase, h *Hook, err error) hookVerdict {
	ok := pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY
	okMsg := "Ready for commands"
	failed := pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED
	if phase == afterLease {
		ok, okMsg = pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, "Available for new lease"
		failed = pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED
	}
	if h == nil || err == nil {
		return hookVerdict{status: ok, msg: okMsg}
	}
	if errors.Is(err, errPolicyReset) {
		return hookVerdict{status: failed, msg: fmt.Sprintf("%s hook failed (the lease state policy's reset, shutting down whatever onFailure): %v", phase, err), exit: true}
	}
	switch h.OnFailure {
	case OnFailureEndLease:
		v := hookVerdict{status: failed, msg: fmt.Sprintf("%s hook failed (onFailure=endLease): %v", phase, err), release: phase == beforeLease}
		if phase == afterLease {
			v.thenAvailable = fmt.Sprintf("%s (%s)", okMsg, v.msg)
		}
		return v
	case OnFailureExit:
		return hookVerdict{status: failed, msg: fmt.Sprintf("%s hook failed (onFailure=exit, shutting down): %v", phase, err), release: phase == beforeLease, exit: true}
	}
	return hookVerdict{status: ok, msg: fmt.Sprintf("%s (%s hook warning: %v)", okMsg, phase, err), warn: true}
}

// hookStatus is the status reported while phase's hook runs.
func hookStatus(phase hookPhase) (pb.ExporterStatus, string) {
	if phase == beforeLease {
		return pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK, "Running beforeLease hook"
	}
	return pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, "Running afterLease hooks"
}

// runHook does h's actions in order within its timeout; the first that
// fails (or the timeout) fails the hook. Each step is a LogStream line.
func (e *Exporter) runHook(ctx context.Context, phase hookPhase, h *Hook) error {
	d := h.Timeout
	if d <= 0 {
		d = DefaultHookTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	op := phase.String() + " hook"
	e.log.Info("lease hook", "phase", phase.String(), "actions", actionNames(h.Actions), "timeout", d.String(), "onFailure", string(h.OnFailure))
	for _, a := range h.Actions {
		e.logs.Add(LogEntry{Message: fmt.Sprintf("%s: %s", op, a), Operation: op})
		err := e.hookAction(ctx, op, a)
		if err == nil && ctx.Err() != nil {
			err = ctx.Err()
		}
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) || ctx.Err() == context.DeadlineExceeded {
				err = fmt.Errorf("timed out after %s in action %s: %w", d, a.Action, err)
			} else {
				err = fmt.Errorf("action %s: %w", a.Action, err)
			}
			if a.policyReset {
				err = fmt.Errorf("%w: %w", errPolicyReset, err)
			}
			e.logs.Add(LogEntry{Severity: SeverityError, Message: fmt.Sprintf("%s failed: %v", op, err), Operation: op})
			return err
		}
	}
	e.logs.Add(LogEntry{Message: op + " done: " + strings.Join(actionNames(h.Actions), ", "), Operation: op})
	return nil
}

func actionNames(as []HookStep) []string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return out
}

// hookAction does one step on the target.
func (e *Exporter) hookAction(ctx context.Context, op string, a HookStep) error {
	t := e.cfg.Target
	switch a.Action {
	case HookPowerOn:
		return t.PowerOn(ctx)
	case HookPowerOff:
		return t.PowerOff(ctx)
	case HookPowerCycle:
		if err := t.PowerOff(ctx); err != nil {
			return err
		}
		return t.PowerOn(ctx)
	case HookReset:
		r, ok := t.(Resetter)
		if !ok {
			return errors.New("this target cannot be reset")
		}
		return r.ResetTarget(ctx)
	case HookExec:
		g, ok := t.(GuestExecer)
		if !ok {
			return errors.New("this target cannot run commands in its guest")
		}
		return e.hookExec(ctx, op, g, a.Command)
	case HookFlash:
		return e.hookFlash(ctx, op, a)
	}
	return fmt.Errorf("unknown hook action %q", a.Action)
}

// hookExec runs argv in the guest, trying again every GuestExecRetry
// while the guest agent does not answer (a guest still booting), until
// ctx (the hook's timeout) ends. A non-zero exit fails with its code and
// the end of stderr.
func (e *Exporter) hookExec(ctx context.Context, op string, g GuestExecer, argv []string) error {
	if len(argv) == 0 || argv[0] == "" {
		return errors.New("exec: no command")
	}
	waiting := false
	for {
		res, err := g.GuestExec(ctx, argv)
		if err == nil {
			if res.ExitCode != 0 {
				return fmt.Errorf("%s exited with code %d: %s", argv[0], res.ExitCode, stderrTail(res.Stderr))
			}
			return nil
		}
		if !errors.Is(err, ErrGuestAgentNotReady) || ctx.Err() != nil {
			return err
		}
		if !waiting {
			waiting = true
			e.log.Info("lease hook waiting for the guest agent", "operation", op, "error", err.Error())
			e.logs.Add(LogEntry{Message: fmt.Sprintf("%s: waiting for the guest agent: %v", op, err), Operation: op})
		}
		t := time.NewTimer(GuestExecRetry)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return err
		}
	}
}

// hookFlash flashes a step's image as flash_oci does for a lease, but
// with no registry credentials (what the node may pull for anyone: never
// a lease's, never the pod's pull secrets), within the node's fetch policy
// (the registry checked before the pull, each connection at its dial), in
// a transfer slot and the transfer timeout, its progress in the LogStream.
func (e *Exporter) hookFlash(ctx context.Context, op string, a HookStep) error {
	f := OCIFlash{Ref: strings.TrimPrefix(a.Image, "oci://"), Partition: cmp.Or(a.Partition, PartitionRoot)}
	if f.Ref == "" || !slices.Contains(Partitions, f.Partition) {
		return fmt.Errorf("%w: flash %q onto partition %q", ErrInvalidArgument, a.Image, a.Partition)
	}
	flash, err := e.ociFlash(ctx, f) // flashauth.go
	if err != nil {
		return err
	}
	progress := func(line string) {
		e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: op, Message: line})
	}
	return e.transfer(ctx, op, progress, flash) // limits.go
}

// stderrTail is the printable end of a command's stderr, at most
// maxStderrTail bytes, on one line. Pure.
func stderrTail(b []byte) string {
	if len(b) > maxStderrTail {
		b = b[len(b)-maxStderrTail:]
	}
	s := strings.Map(func(r rune) rune {
		switch {
		case r == '\n' || r == '\t' || r == '\r':
			return ' '
		case r == utf8.RuneError || !unicode.IsPrint(r):
			return '?'
		}
		return r
	}, strings.ToValidUTF8(string(b), "?"))
	if s = strings.TrimSpace(s); s == "" {
		return "(no stderr)"
	}
	return s
}

// runPhase runs phase's hook h (nil: none) and reports its statuses: the
// hook's while it runs, then the verdict's. It returns the verdict.
func (e *Exporter) runPhase(ctx context.Context, rep *statusReporter, phase hookPhase, h *Hook) (hookVerdict, error) {
	var err error
	if h != nil {
		st, msg := hookStatus(phase)
		if rerr := rep.report(ctx, st, msg); rerr != nil {
			return hookVerdict{}, rerr
		}
		err = e.runHook(ctx, phase, h)
		if err != nil {
			e.log.Info("lease hook failed", "phase", phase.String(), "onFailure", string(h.OnFailure), "error", err.Error())
		}
	}
	v := decideHook(phase, h, err)
	if v.status == pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY {
		return v, nil // reported once Listen is open
	}
	if v.status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE && e.cfg.ExitOnLeaseEnd {
		return v, nil // it exits now: never AVAILABLE again (no lease lands on it)
	}
	if rerr := rep.reportRelease(ctx, v.status, v.msg, v.release); rerr != nil {
		return v, rerr
	}
	return v, nil
}

// afterLeasePhase runs when a lease ended (Run goroutine): the reset and
// the afterLease hook, before anything else is served; their verdict is
// the status (step.available, the AVAILABLE message, follows it). A hook
// that failed with onFailure endLease is reported for
// AfterLeaseFailedHold, then AVAILABLE with the failure in its message
// (unless the next lease is already assigned). A hook with onFailure exit
// that failed ends the session with ErrHookExit. An exporter that exits
// on lease end skips the reset (its target serves no other lease).
func (e *Exporter) afterLeasePhase(ctx context.Context, rep *statusReporter, step *leaseStep) error {
	hooks := e.cfg.Hooks
	hooks.ResetAfterLease = hooks.ResetAfterLease && !e.cfg.ExitOnLeaseEnd
	h := afterLeaseHook(hooks)
	if h == nil {
		return nil
	}
	v, err := e.runPhase(ctx, rep, afterLease, h)
	if err != nil {
		return err
	}
	if v.exit {
		return fmt.Errorf("%s: %w", v.msg, ErrHookExit)
	}
	switch {
	case v.status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE:
		if step.available != "" {
			step.available = v.msg
		}
	case v.thenAvailable != "" && step.available != "":
		t := time.NewTimer(AfterLeaseFailedHold)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		step.available = v.thenAvailable
	default:
		step.available = "" // the failed status stays until the next lease
		e.setState(StateOnline, nil)
	}
	return nil
}

// beforeLeasePhase runs the beforeLease hook of a lease just assigned
// (Run goroutine): its drivers are served (LEASE_READY) once it passed
// and Listen is open (leaseReady).
func (e *Exporter) beforeLeasePhase(ctx context.Context, rep *statusReporter, lr *leaseRun) error {
	v, err := e.runPhase(ctx, rep, beforeLease, e.cfg.Hooks.BeforeLease)
	if err != nil {
		return err
	}
	if v.exit {
		return fmt.Errorf("%s: %w", v.msg, ErrHookExit)
	}
	lr.ready, lr.readyMsg = v.status == pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, v.msg
	return e.leaseReady(ctx, rep, lr)
}

// leaseReady reports LEASE_READY once the lease's beforeLease hook passed
// and its Listen is open (StateLeased).
func (e *Exporter) leaseReady(ctx context.Context, rep *statusReporter, lr *leaseRun) error {
	if !lr.ready || !lr.open {
		return nil
	}
	if err := rep.report(ctx, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, lr.readyMsg); err != nil {
		return err
	}
	e.setState(StateLeased, nil)
	return nil
}
