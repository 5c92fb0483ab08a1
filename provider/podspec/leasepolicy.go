package podspec

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// What a pod's exporter does around its leases: the lease state policy and
// the lease hooks its set gave it (annotations
// qemu-kubelet.io/lease-state-policy and qemu-kubelet.io/lease-hooks),
// read and checked here for admission and the exporter alike.

// DefaultLeaseHookTimeout is a hook's timeout when it names none
// (Jumpstarter's default).
const DefaultLeaseHookTimeout = 120 * time.Second

// MaxLeaseHookActions bounds the actions of one hook.
const MaxLeaseHookActions = 8

// maxLeaseHookTimeout bounds a hook's timeout, in seconds.
const maxLeaseHookTimeout = 3600

// LeaseSettings are a pod's lease state policy and hooks, checked.
type LeaseSettings struct {
	// Keep: the pod's leases leave their state for the next one
	// (LeaseStatePolicyKeep); else each lease ends with a reset.
	Keep bool
	// BeforeLease and AfterLease are the hooks (nil: none).
	BeforeLease, AfterLease *LeaseHookSettings
}

// LeaseHookSettings is one hook, defaults filled in.
type LeaseHookSettings struct {
	Actions   []v1alpha1.LeaseHookStep
	Timeout   time.Duration
	OnFailure v1alpha1.LeaseHookOnFailure
}

// LeaseSettingsOf reads the pod's lease settings from its annotations; a
// bad value is an error naming the annotation and what is wrong. Pure.
func LeaseSettingsOf(pod *corev1.Pod) (LeaseSettings, error) {
	var ls LeaseSettings
	switch p := v1alpha1.LeaseStatePolicy(pod.Annotations[v1alpha1.LeaseStatePolicyAnnotation]); p {
	case "", v1alpha1.LeaseStatePolicyReset:
	case v1alpha1.LeaseStatePolicyKeep:
		ls.Keep = true
	default:
		return ls, fmt.Errorf("annotation %s: lease state policy %q: want Reset or Keep", v1alpha1.LeaseStatePolicyAnnotation, p)
	}
	raw, ok := pod.Annotations[v1alpha1.LeaseHooksAnnotation]
	if !ok {
		return ls, nil
	}
	var hooks v1alpha1.LeaseHooks
	dec := json.NewDecoder(bytes.NewReader([]byte(raw)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&hooks); err != nil {
		return ls, fmt.Errorf("annotation %s: not lease hooks as JSON ({\"beforeLease\":{\"actions\":[...]}}): %w", v1alpha1.LeaseHooksAnnotation, err)
	}
	var err error
	if ls.BeforeLease, err = leaseHook("beforeLease", hooks.BeforeLease); err != nil {
		return ls, err
	}
	if ls.AfterLease, err = leaseHook("afterLease", hooks.AfterLease); err != nil {
		return ls, err
	}
	return ls, nil
}

// leaseHook checks one hook and fills its defaults (nil: none).
func leaseHook(name string, h *v1alpha1.LeaseHook) (*LeaseHookSettings, error) {
	if h == nil {
		return nil, nil
	}
	where := fmt.Sprintf("annotation %s: %s", v1alpha1.LeaseHooksAnnotation, name)
	if len(h.Actions) == 0 || len(h.Actions) > MaxLeaseHookActions {
		return nil, fmt.Errorf("%s: %d actions: want 1 to %d", where, len(h.Actions), MaxLeaseHookActions)
	}
	s := &LeaseHookSettings{Timeout: DefaultLeaseHookTimeout, OnFailure: v1alpha1.LeaseHookWarn}
	for i, a := range h.Actions {
		if err := a.Check(); err != nil {
			return nil, fmt.Errorf("%s: actions[%d]: %w", where, i, err)
		}
		a.Command = slices.Clone(a.Command)
		s.Actions = append(s.Actions, a)
	}
	if h.Timeout != 0 {
		if h.Timeout < 1 || h.Timeout > maxLeaseHookTimeout {
			return nil, fmt.Errorf("%s: timeout %d s: want 1 to %d", where, h.Timeout, maxLeaseHookTimeout)
		}
		s.Timeout = time.Duration(h.Timeout) * time.Second
	}
	switch h.OnFailure {
	case "":
	case v1alpha1.LeaseHookWarn, v1alpha1.LeaseHookEndLease, v1alpha1.LeaseHookExit:
		s.OnFailure = h.OnFailure
	default:
		return nil, fmt.Errorf("%s: onFailure %q: want warn, endLease or exit", where, h.OnFailure)
	}
	return s, nil
}
