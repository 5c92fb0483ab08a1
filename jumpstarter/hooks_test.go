package jumpstarter

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// What runs when a lease ends, from the lease state policy and the
// afterLease hook.
func TestAfterLeaseHook(t *testing.T) {
	off := &Hook{Actions: []HookStep{{Action: HookPowerOff}}, Timeout: time.Minute, OnFailure: OnFailureEndLease}
	for _, c := range []struct {
		name  string
		hooks LeaseHooks
		want  *Hook
	}{
		{"keep, no hook: nothing", LeaseHooks{}, nil},
		{"keep, a hook: the hook", LeaseHooks{AfterLease: off}, off},
		{"reset alone: reset, a failure takes the exporter offline", LeaseHooks{ResetAfterLease: true},
			&Hook{Actions: []HookStep{{Action: HookReset, policyReset: true}}, OnFailure: OnFailureExit}},
		{"reset then the hook's actions, under the hook's timeout and onFailure", LeaseHooks{ResetAfterLease: true, AfterLease: off},
			&Hook{Actions: []HookStep{{Action: HookReset, policyReset: true}, {Action: HookPowerOff}}, Timeout: time.Minute, OnFailure: OnFailureEndLease}},
		{"a beforeLease hook does not run at the end", LeaseHooks{BeforeLease: off}, nil},
	} {
		assert.Equal(t, c.want, afterLeaseHook(c.hooks), c.name)
	}
	// afterLeaseHook never changes the declared hook.
	h := LeaseHooks{ResetAfterLease: true, AfterLease: off}
	afterLeaseHook(h)
	assert.Equal(t, []HookStep{{Action: HookPowerOff}}, off.Actions)
}

// What a hook's outcome means, per phase and onFailure, as upstream's
// exporter does it.
func TestDecideHook(t *testing.T) {
	const (
		ready      = pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY
		available  = pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
		beforeFail = pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED
		afterFail  = pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED
	)
	hook := func(f OnFailure) *Hook { return &Hook{Actions: []HookStep{{Action: HookPowerOn}}, OnFailure: f} }
	boom := errors.New("boom")
	for _, c := range []struct {
		name  string
		phase hookPhase
		h     *Hook
		err   error
		want  hookVerdict
	}{
		{"before, none", beforeLease, nil, nil, hookVerdict{status: ready, msg: "Ready for commands"}},
		{"before, passed", beforeLease, hook(OnFailureExit), nil, hookVerdict{status: ready, msg: "Ready for commands"}},
		{"before, warn", beforeLease, hook(OnFailureWarn), boom, hookVerdict{status: ready, msg: "Ready for commands (beforeLease hook warning: boom)", warn: true}},
		{"before, unset onFailure is warn", beforeLease, hook(""), boom, hookVerdict{status: ready, msg: "Ready for commands (beforeLease hook warning: boom)", warn: true}},
		{"before, endLease: failed, released", beforeLease, hook(OnFailureEndLease), boom,
			hookVerdict{status: beforeFail, msg: "beforeLease hook failed (onFailure=endLease): boom", release: true}},
		{"before, exit: failed, released, offline", beforeLease, hook(OnFailureExit), boom,
			hookVerdict{status: beforeFail, msg: "beforeLease hook failed (onFailure=exit, shutting down): boom", release: true, exit: true}},
		{"after, none", afterLease, nil, nil, hookVerdict{status: available, msg: "Available for new lease"}},
		{"after, passed", afterLease, hook(OnFailureExit), nil, hookVerdict{status: available, msg: "Available for new lease"}},
		{"after, warn", afterLease, hook(OnFailureWarn), boom, hookVerdict{status: available, msg: "Available for new lease (afterLease hook warning: boom)", warn: true}},
		{"after, endLease: failed, nothing to release, then available keeping the failure", afterLease, hook(OnFailureEndLease), boom,
			hookVerdict{status: afterFail, msg: "afterLease hook failed (onFailure=endLease): boom",
				thenAvailable: "Available for new lease (afterLease hook failed (onFailure=endLease): boom)"}},
		{"after, the policy's reset failed, warn: failed, offline all the same", afterLease, hook(OnFailureWarn), fmt.Errorf("%w: action reset: boom", errPolicyReset),
			hookVerdict{status: afterFail, msg: "afterLease hook failed (the lease state policy's reset, shutting down whatever onFailure): the lease state policy's reset failed: action reset: boom", exit: true}},
		{"after, the policy's reset failed, endLease: failed, offline all the same", afterLease, hook(OnFailureEndLease), fmt.Errorf("%w: action reset: boom", errPolicyReset),
			hookVerdict{status: afterFail, msg: "afterLease hook failed (the lease state policy's reset, shutting down whatever onFailure): the lease state policy's reset failed: action reset: boom", exit: true}},
		{"after, exit: failed, offline", afterLease, hook(OnFailureExit), boom,
			hookVerdict{status: afterFail, msg: "afterLease hook failed (onFailure=exit, shutting down): boom", exit: true}},
	} {
		assert.Equal(t, c.want, decideHook(c.phase, c.h, c.err), c.name)
	}
	for _, p := range []hookPhase{beforeLease, afterLease} {
		st, msg := hookStatus(p)
		assert.Contains(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK}, st)
		assert.Contains(t, msg, fmt.Sprint(p))
	}
}

// The end of a failed command's stderr, as a hook's error quotes it.
func TestStderrTail(t *testing.T) {
	long := strings.Repeat("a", 2*maxStderrTail) + "the end"
	for _, c := range []struct{ name, in, want string }{
		{"empty", "", "(no stderr)"},
		{"blank", " \n\t", "(no stderr)"},
		{"one line", "no such file\n", "no such file"},
		{"lines joined, control bytes and bad UTF-8 replaced", "a\nb\x00c\x1b\xff", "a b?c??"},
		{"printable non-ASCII kept", "échec", "échec"},
		{"the end of a long one", long, strings.Repeat("a", maxStderrTail-len("the end")) + "the end"},
	} {
		assert.Equal(t, c.want, stderrTail([]byte(c.in)), c.name)
	}
}
