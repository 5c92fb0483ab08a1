package controller

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Reasons of the ReplicaFailure condition when a set's class cannot be
// applied; the set then creates and deletes nothing.
const (
	ReasonClassNotFound      = "ClassNotFound"
	ReasonInvalidParameters  = "InvalidParameters"
	ReasonInvalidJumpstarter = "InvalidJumpstarter"
	ReasonInvalidBindingMode = "InvalidBindingMode"
)

// MaxParametersBytes bounds a set's effective parameters as JSON: they ride
// in a pod annotation (all annotations of an object share 256 KiB).
const MaxParametersBytes = 64 << 10

// defaultVMContainer is the container a class adds to a template that has
// none.
const defaultVMContainer = "vm"

// ClassError says why a class cannot be applied to a set: the reason and
// message of the ReplicaFailure condition.
type ClassError struct{ Reason, Message string }

func (e *ClassError) Error() string { return e.Reason + ": " + e.Message }

// Resolved is a set with its class applied.
type Resolved struct {
	// Set is a copy of the set whose spec has the class applied: template
	// defaults, the parameters annotation and environment variable, the
	// merged Jumpstarter settings. Pods are created from it and its
	// template hash (setHash) covers everything the class gives them.
	Set *v1alpha1.ExporterSet
	// Parameters are the effective parameters as canonical JSON (compact,
	// keys sorted); nil when there are none.
	Parameters []byte
	// Class is what the set took from its class; nil without one.
	Class *v1alpha1.ClassStatus
	// BindingMode in effect (Immediate without a class).
	BindingMode v1alpha1.BindingMode
	// StatePolicy in effect: the set's, else the class's, else Disabled.
	StatePolicy v1alpha1.StatePolicy
}

// Resolve applies class to a copy of set. class is the object set's
// spec.className names, nil when that does not exist (or when the set names
// none). It is pure: the same set and class always give the same result.
// A set without class and without parameters resolves to an unchanged copy
// (same template hash as before classes existed).
func Resolve(set *v1alpha1.ExporterSet, class *v1alpha1.VirtualTargetClass) (*Resolved, *ClassError) {
	eff := set.DeepCopy()
	res := &Resolved{Set: eff, BindingMode: v1alpha1.BindingModeImmediate}
	var cs *v1alpha1.VirtualTargetClassSpec
	if set.Spec.ClassName != "" {
		if class == nil {
			return nil, &ClassError{ReasonClassNotFound, fmt.Sprintf("VirtualTargetClass %q not found in namespace %s; nothing is created until it exists",
				set.Spec.ClassName, set.Namespace)}
		}
		cs = &class.Spec
		res.Class = &v1alpha1.ClassStatus{Name: class.Name, Generation: class.Generation,
			BindingMode: orDefault(cs.BindingMode, v1alpha1.BindingModeImmediate), ReclaimPolicy: orDefault(cs.ReclaimPolicy, v1alpha1.ReclaimPolicyDelete)}
		res.BindingMode = res.Class.BindingMode
	}
	res.StatePolicy = EffectiveStatePolicy(set.Spec.StatePolicy, cs)
	if res.Class != nil {
		res.Class.StatePolicy = res.StatePolicy
	}

	var base []byte
	if cs != nil && cs.Parameters != nil {
		base = cs.Parameters.Raw
	}
	var over []byte
	if set.Spec.Parameters != nil {
		over = set.Spec.Parameters.Raw
	}
	params, err := MergeParameters(base, over)
	if err != nil {
		return nil, &ClassError{ReasonInvalidParameters, err.Error()}
	}
	res.Parameters = params

	t := &eff.Spec.Template
	if cs != nil {
		applyClassDefaults(t, cs)
	}
	// Only non-default values become annotations: a set that asks for
	// nothing keeps the template hash it had before these existed.
	reclaimRetain := res.Class != nil && res.Class.ReclaimPolicy == v1alpha1.ReclaimPolicyRetain
	stateRetain := res.StatePolicy == v1alpha1.StatePolicyRetain
	if params != nil || reclaimRetain || stateRetain {
		ann := maps.Clone(t.Annotations)
		if ann == nil {
			ann = map[string]string{}
		}
		if params != nil {
			ann[v1alpha1.ParametersAnnotation] = string(params)
		}
		if reclaimRetain {
			ann[v1alpha1.ReclaimPolicyAnnotation] = string(v1alpha1.ReclaimPolicyRetain)
		}
		if stateRetain {
			ann[v1alpha1.StatePolicyAnnotation] = string(v1alpha1.StatePolicyRetain)
		}
		t.Annotations = ann
	}
	if params != nil && len(t.Spec.Containers) > 0 {
		c := &t.Spec.Containers[0]
		if !hasEnv(c.Env, v1alpha1.ParametersEnv) {
			c.Env = append(c.Env, corev1.EnvVar{Name: v1alpha1.ParametersEnv, ValueFrom: &corev1.EnvVarSource{
				FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: fmt.Sprintf("metadata.annotations['%s']", v1alpha1.ParametersAnnotation)}}})
		}
	}

	if cs != nil && cs.Jumpstarter != nil {
		js := &v1alpha1.JumpstarterSpec{Endpoint: cs.Jumpstarter.Endpoint, CABundle: cs.Jumpstarter.CABundle,
			ExporterLabels: maps.Clone(cs.Jumpstarter.ExporterLabels), LeaseStatePolicy: cs.Jumpstarter.LeaseStatePolicy,
			Hooks: cs.Jumpstarter.Hooks.DeepCopy()}
		if own := set.Spec.Jumpstarter; own != nil {
			if own.Endpoint != "" {
				js.Endpoint = own.Endpoint
			}
			if own.CABundle != "" {
				js.CABundle = own.CABundle
			}
			js.GuestLoginSecretName = own.GuestLoginSecretName // the set's alone: a class names no Secret of the set's namespace
			js.DefaultGuestLogin = own.DefaultGuestLogin       // the set's alone, as its login Secret
			js.SSHDriver = own.SSHDriver                       // the set's alone, as its default login
			js.VNCDriver = own.VNCDriver                       // the set's alone, as sshDriver
			js.LeaseStatePolicy = orDefault(own.LeaseStatePolicy, cs.Jumpstarter.LeaseStatePolicy)
			js.Hooks = cs.Jumpstarter.Hooks.DeepCopy()
			if own.Hooks != nil {
				js.Hooks = own.Hooks.DeepCopy()
			}
			if js.ExporterLabels == nil {
				js.ExporterLabels = map[string]string{}
			}
			maps.Copy(js.ExporterLabels, own.ExporterLabels)
		}
		eff.Spec.Jumpstarter = js
	}
	if js := eff.Spec.Jumpstarter; js != nil && len(js.ExporterLabels) == 0 {
		return nil, &ClassError{ReasonInvalidJumpstarter, "Jumpstarter mode needs exporter labels: set spec.jumpstarter.exporterLabels or the class's spec.jumpstarter.exporterLabels"}
	}
	if js := eff.Spec.Jumpstarter; js != nil {
		if err := checkLeaseHooks(js.Hooks); err != nil {
			return nil, &ClassError{ReasonInvalidJumpstarter, err.Error()}
		}
		ann := LeaseAnnotations(js, eff.Spec.RecyclePolicy)
		maps.Copy(ann, DriverAnnotations(js))
		if len(ann) > 0 {
			t.Annotations = maps.Clone(t.Annotations)
			if t.Annotations == nil {
				t.Annotations = map[string]string{}
			}
			maps.Copy(t.Annotations, ann)
		}
	}
	if res.BindingMode == v1alpha1.BindingModeWaitForFirstConsumer && eff.Spec.Jumpstarter == nil {
		return nil, &ClassError{ReasonInvalidBindingMode, fmt.Sprintf("class %s has bindingMode WaitForFirstConsumer, which needs Jumpstarter mode (pending Leases ask for pods); with label leases a pod is claimed only after it exists, so no pod would ever be created",
			set.Spec.ClassName)}
	}
	return res, nil
}

// LeaseAnnotations are the pod annotations that carry a set's effective
// lease state policy and lease hooks to its pods' exporters: only what
// differs from the node's default (Reset, no hooks). A pod of a set that
// does not recycle with Reuse is deleted when its lease ends, so it gets
// Keep: a reset would only boot a VM about to be deleted. Pure.
func LeaseAnnotations(js *v1alpha1.JumpstarterSpec, recycle v1alpha1.RecyclePolicy) map[string]string {
	ann := map[string]string{}
	if js.LeaseStatePolicy == v1alpha1.LeaseStatePolicyKeep || recycle != v1alpha1.RecyclePolicyReuse {
		ann[v1alpha1.LeaseStatePolicyAnnotation] = string(v1alpha1.LeaseStatePolicyKeep)
	}
	if js.Hooks != nil && (js.Hooks.BeforeLease != nil || js.Hooks.AfterLease != nil) {
		b, err := json.Marshal(js.Hooks)
		if err == nil { // plain structs of strings and numbers always marshal
			ann[v1alpha1.LeaseHooksAnnotation] = string(b)
		}
	}
	return ann
}

// DriverAnnotations are the pod annotations that switch off the child
// drivers a pod's exporter reports by default: only what differs from
// the node's default (every default driver on), so a set that asks for
// nothing keeps its template hash. Pure.
func DriverAnnotations(js *v1alpha1.JumpstarterSpec) map[string]string {
	ann := map[string]string{}
	if js.SSHDriver == v1alpha1.DriverDisabled {
		ann[v1alpha1.SSHDriverAnnotation] = string(v1alpha1.DriverDisabled)
	}
	if js.VNCDriver == v1alpha1.DriverDisabled {
		ann[v1alpha1.DisplayAnnotation] = v1alpha1.DisplayNone // over the template's own
	}
	return ann
}

// checkLeaseHooks checks each step of the effective hooks (the CRD's
// schema checks them too; a node refuses pods with bad ones), so a bad
// step is the set's condition, not pods that fail on their node. Pure.
func checkLeaseHooks(h *v1alpha1.LeaseHooks) error {
	if h == nil {
		return nil
	}
	for _, p := range []struct {
		name string
		hook *v1alpha1.LeaseHook
	}{{"beforeLease", h.BeforeLease}, {"afterLease", h.AfterLease}} {
		if p.hook == nil {
			continue
		}
		for i, a := range p.hook.Actions {
			if err := a.Check(); err != nil {
				return fmt.Errorf("spec.jumpstarter.hooks.%s.actions[%d]: %w", p.name, i, err)
			}
		}
	}
	return nil
}

// EffectiveStatePolicy is a set's state policy: its own (set), else its
// class's (cs, nil without a class), else Disabled. Pure.
func EffectiveStatePolicy(set v1alpha1.StatePolicy, cs *v1alpha1.VirtualTargetClassSpec) v1alpha1.StatePolicy {
	if set != "" {
		return set
	}
	if cs != nil && cs.StatePolicy != "" {
		return cs.StatePolicy
	}
	return v1alpha1.StatePolicyDisabled
}

func orDefault[T ~string](v, def T) T {
	if v == "" {
		return def
	}
	return v
}

func hasEnv(env []corev1.EnvVar, name string) bool {
	for _, e := range env {
		if e.Name == name {
			return true
		}
	}
	return false
}

// applyClassDefaults fills what the template leaves unset from the class:
// nodeSelector keys (the template's win), tolerations (added, duplicates
// left out), runtimeClassName, topologySpreadConstraints, and for the VM
// container (the first; one named "vm" is added to a template without
// containers) image, probes and the requests and limits per resource name,
// and the grace period.
func applyClassDefaults(t *corev1.PodTemplateSpec, cs *v1alpha1.VirtualTargetClassSpec) {
	spec := &t.Spec
	if sc := cs.Scheduling; sc != nil {
		if len(sc.NodeSelector) > 0 {
			ns := maps.Clone(sc.NodeSelector)
			maps.Copy(ns, spec.NodeSelector)
			spec.NodeSelector = ns
		}
		for _, tol := range sc.Tolerations {
			dup := false
			for _, have := range spec.Tolerations {
				if equality.Semantic.DeepEqual(have, tol) {
					dup = true
					break
				}
			}
			if !dup {
				spec.Tolerations = append(spec.Tolerations, *tol.DeepCopy())
			}
		}
		if spec.RuntimeClassName == nil && sc.RuntimeClassName != nil {
			spec.RuntimeClassName = new(*sc.RuntimeClassName)
		}
		if len(spec.TopologySpreadConstraints) == 0 && len(sc.TopologySpreadConstraints) > 0 {
			for _, c := range sc.TopologySpreadConstraints {
				spec.TopologySpreadConstraints = append(spec.TopologySpreadConstraints, *c.DeepCopy())
			}
		}
	}
	pd := cs.PodDefaults
	if pd != nil && spec.TerminationGracePeriodSeconds == nil && pd.TerminationGracePeriodSeconds != nil {
		spec.TerminationGracePeriodSeconds = new(*pd.TerminationGracePeriodSeconds)
	}
	if len(spec.Containers) == 0 && (pd != nil || cs.Scheduling != nil && cs.Scheduling.Resources != nil) {
		spec.Containers = []corev1.Container{{Name: defaultVMContainer}}
	}
	if len(spec.Containers) == 0 {
		return
	}
	c := &spec.Containers[0]
	if pd != nil {
		if c.Image == "" {
			c.Image = pd.Image
		}
		if c.ReadinessProbe == nil && pd.ReadinessProbe != nil {
			c.ReadinessProbe = pd.ReadinessProbe.DeepCopy()
		}
		if c.LivenessProbe == nil && pd.LivenessProbe != nil {
			c.LivenessProbe = pd.LivenessProbe.DeepCopy()
		}
		if c.StartupProbe == nil && pd.StartupProbe != nil {
			c.StartupProbe = pd.StartupProbe.DeepCopy()
		}
	}
	if sc := cs.Scheduling; sc != nil && sc.Resources != nil {
		c.Resources.Requests = fillResources(c.Resources.Requests, sc.Resources.Requests)
		c.Resources.Limits = fillResources(c.Resources.Limits, sc.Resources.Limits)
	}
}

// fillResources adds to have the resources of def it does not name.
func fillResources(have, def corev1.ResourceList) corev1.ResourceList {
	if len(def) == 0 {
		return have
	}
	out := make(corev1.ResourceList, len(have)+len(def))
	for k, v := range def {
		out[k] = v.DeepCopy()
	}
	for k, v := range have {
		out[k] = v.DeepCopy()
	}
	return out
}

// MergeParameters deep-merges the JSON object override over the JSON
// object base, as a JSON merge patch (RFC 7386) applies: objects merge key
// by key, recursively; a list, a scalar or a value of another type in
// override replaces base's; null in override removes the key. The result
// is canonical JSON (compact, object keys sorted, numbers exactly as
// written) so that equal parameters always hash alike; nil when the merged
// object is empty. Empty input counts as no parameters. An input that is
// not a JSON object, or a result above MaxParametersBytes, is an error
// naming which.
//
// (evanphx/json-patch's MergePatch does the same merge but keeps the
// input's key order, and v4 turns numbers into float64.)
func MergeParameters(base, override []byte) ([]byte, error) {
	b, err := parseObject(base, "the class's parameters")
	if err != nil {
		return nil, err
	}
	o, err := parseObject(override, "the set's parameters")
	if err != nil {
		return nil, err
	}
	merged, _ := mergeValue(b, o).(map[string]any)
	if len(merged) == 0 {
		return nil, nil
	}
	out, err := json.Marshal(merged) // maps marshal with sorted keys
	if err != nil {
		return nil, fmt.Errorf("encode merged parameters: %w", err)
	}
	if len(out) > MaxParametersBytes {
		return nil, fmt.Errorf("merged parameters are %d bytes of JSON, more than the %d allowed (they ride in a pod annotation)", len(out), MaxParametersBytes)
	}
	return out, nil
}

// parseObject decodes raw as a JSON object (numbers as json.Number); empty
// raw or null is an empty object.
func parseObject(raw []byte, what string) (map[string]any, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return map[string]any{}, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("%s are not valid JSON: %w", what, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%s are not one JSON value", what)
	}
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s must be a JSON object, not %s", what, jsonKind(v))
	}
	return m, nil
}

// mergeValue applies over to base (RFC 7386 MergePatch): over replaces base
// unless both are objects, which merge key by key; null in an object of
// over removes the key.
func mergeValue(base, over any) any {
	o, ok := over.(map[string]any)
	if !ok {
		return over
	}
	b, _ := base.(map[string]any)
	out := make(map[string]any, len(b)+len(o))
	maps.Copy(out, b)
	for k, v := range o {
		if v == nil {
			delete(out, k)
			continue
		}
		out[k] = mergeValue(out[k], v)
	}
	return out
}

// scalarText is a JSON string or number (decoded with UseNumber) as text;
// false for anything else.
func scalarText(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case json.Number:
		return x.String(), true
	}
	return "", false
}

func jsonKind(v any) string {
	switch v.(type) {
	case []any:
		return "an array"
	case string:
		return "a string"
	case json.Number:
		return "a number"
	case bool:
		return "a boolean"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%T", v)
}
