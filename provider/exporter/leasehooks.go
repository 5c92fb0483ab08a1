package exporter

import (
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
)

// leaseHooks are the exporter's lease hooks from the pod's lease settings
// (podspec.LeaseSettingsOf: the set's leaseStatePolicy and hooks). Pure.
func leaseHooks(ls podspec.LeaseSettings) jumpstarter.LeaseHooks {
	return jumpstarter.LeaseHooks{ResetAfterLease: !ls.Keep, BeforeLease: leaseHook(ls.BeforeLease), AfterLease: leaseHook(ls.AfterLease)}
}

func leaseHook(h *podspec.LeaseHookSettings) *jumpstarter.Hook {
	if h == nil {
		return nil
	}
	out := &jumpstarter.Hook{Timeout: h.Timeout, OnFailure: jumpstarter.OnFailure(h.OnFailure)}
	for _, a := range h.Actions {
		step := jumpstarter.HookStep{Action: jumpstarter.HookAction(a.Action), Command: a.Command}
		if f := a.Flash; f != nil {
			step.Image, step.Partition = f.Image, f.Partition
		}
		out.Actions = append(out.Actions, step)
	}
	return out
}

// leaseStateNote says in the exporter condition what a lease leaves for
// the next one.
func leaseStateNote(h jumpstarter.LeaseHooks) string {
	if h.ResetAfterLease {
		return "lease state policy Reset: each lease ends with the VM reset to the pod's definition"
	}
	return "lease state policy Keep: each lease leaves the VM as it is for the next one"
}
